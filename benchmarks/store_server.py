"""A TCPStore server in a process of its own, for the control-plane benchmark: its host and
port, its CPU time, and the requests it served, counted from its own log.

How requests are counted: the server runs with TORCH_CPP_LOG_LEVEL=INFO and
TORCH_DISTRIBUTED_DEBUG=DETAIL, under which torch's libuv store backend writes one trace line
per request it processes ("[c10d - trace] get key:/... address:..."), in the order it processes
them. A measurement is bracketed by two marker requests (`mark(store, label)` sets key
"bench/mark/<label>" on a client of the server); `requests(label)` counts the lines between the
two markers by operation. The lines' own timestamps are not used: their sub-second part is off
by a constant modulo one second in torch 2.13's log prefix. Connection set-up lines (validate,
ping) are not requests of the caller's. The log costs the server CPU, so `cpu_s()` is read from
runs without it (`count=False`).

    server = StoreServer(count=True)
    ... ranks: dist.TCPStore(server.host, server.port, world, is_master=False) ...
    mark(store, "run/start"); ...steps...; mark(store, "run/end")
    server.requests("run")   # {"get": 12, "wait": 12, "set": 3, ...}
    server.close()
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile
import time

_SERVER = r'''
import datetime, sys, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=600), wait_for_workers=False)
print(store.port, flush=True)
sys.stdin.read()  # until the parent closes it
'''
_LINE = re.compile(r"^\[I\S+ \S+ \S+\] \[c10d - trace\] (\w+) (?:key:(\S+))?")
MARK = "bench/mark/"
NOT_REQUESTS = {"validate", "ping"}  # a client's connection handshake (requests name their address)


class StoreServer:
    """Starts the server process (`count`: with its per-request log)."""

    def __init__(self, count: bool = True):
        env = dict(os.environ)
        self._log = None
        if count:
            env.update(TORCH_CPP_LOG_LEVEL="INFO", TORCH_DISTRIBUTED_DEBUG="DETAIL")
            self._log = tempfile.NamedTemporaryFile("w+", prefix="store_server_", suffix=".log", delete=False)
        self._proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._log or subprocess.DEVNULL, text=True, env=env)
        self.host, self.port, self.pid = "127.0.0.1", int(self._proc.stdout.readline()), self._proc.pid

    def cpu_s(self) -> float:
        """User + system CPU seconds the server process used so far."""
        fields = open(f"/proc/{self.pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def requests(self, label: str, keys: bool = False) -> collections.Counter:
        """Requests the server processed between the markers "<label>/start" and "<label>/end"
        (see mark), by operation (`keys`: by operation and key); the markers themselves are not
        counted."""
        assert self._log is not None, "a server started with count=False does not count"
        self._log.flush()
        out: collections.Counter = collections.Counter()
        inside = False
        with open(self._log.name) as f:
            for line in f:
                m = _LINE.match(line)
                if not m or m.group(1) in NOT_REQUESTS or " address:" not in line:
                    continue
                op, key = m.groups()
                if key and key.lstrip("/") == f"{MARK}{label}/start":
                    inside = True
                elif key and key.lstrip("/") == f"{MARK}{label}/end":
                    return out
                elif inside:
                    out[f"{op} {key}" if keys else op] += 1
        raise RuntimeError(f"markers of '{label}' not both in the server's log")

    def stop(self) -> None:
        """Ends the server process (as when its host dies)."""
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def close(self) -> None:
        try:
            self._proc.stdin.close()
            self._proc.wait(timeout=10)
        except (subprocess.TimeoutExpired, OSError):
            self.stop()
        if self._log is not None:
            self._log.close()
            os.unlink(self._log.name)


def mark(store, label: str) -> None:
    """A marker request (a set of key "bench/mark/<label>") through `store`, a client of the
    counting server without prefix."""
    store.set(MARK + label, "1")


def settle(seconds: float = 0.3) -> None:
    """Lets the server write what it processed so far."""
    time.sleep(seconds)
