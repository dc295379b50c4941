"""The schedule's `timeout` against the process groups' own: a warning where zbpipe could not
raise first.

Every wait of a step is bounded by the schedule's `timeout`, after which the rank raises
PipelineError naming the action and the peer. On NCCL the group's own timeout is enforced by
ProcessGroupNCCL's watchdog, which by default tears the whole process down
(TORCH_NCCL_ASYNC_ERROR_HANDLING): a `timeout` at or above it lets the watchdog kill the process
before zbpipe can raise. Gloo's own timeout only fails the operation (and zbpipe's messages on
Gloo wait with zbpipe's deadline), so Gloo groups are not checked.
"""

from __future__ import annotations

import datetime
import warnings

import torch


def group_timeout_s(group, device: torch.device) -> tuple[str, float] | None:
    """(backend name, its own timeout in seconds) of `group`'s backend for `device`, or None
    where the group has none or does not say."""
    try:
        backend = group._get_backend(torch.device(device))
        timeout = backend.options._timeout
        name = backend.name()
    except Exception:  # noqa: BLE001 - a backend without options (loopback, custom): nothing to compare
        return None
    if isinstance(timeout, datetime.timedelta):
        return name, timeout.total_seconds()
    return None


def warn_if_not_below(timeout_s: float, groups, device) -> list[str]:
    """Warns (UserWarning) for each group whose non-Gloo backend's own timeout is not above
    `timeout_s`; returns the warnings' texts."""
    said = []
    for group in groups:
        found = group_timeout_s(group, device)
        if found is None or found[0].lower() == "gloo":
            continue
        name, own = found
        if timeout_s >= own:
            text = (f"zbpipe: timeout={timeout_s:g} s is not below the {name} group's own timeout "
                    f"({own:g} s): its watchdog may end the process before zbpipe raises its error "
                    f"naming the rank and action; give the schedule a smaller timeout or the group "
                    f"a larger one (docs/runtime.md#timeouts)")
            warnings.warn(text, UserWarning, stacklevel=3)
            said.append(text)
    return said
