"""zbpipe.bench.emulated: an emulated block spends F in its forward, I in the input gradient and
W in the weight gradient, and zbpipe's split backward puts each where it belongs."""

from __future__ import annotations

import time

import pytest
import torch

from zbpipe import _C
from zbpipe.bench.emulated import EmulatedBlock


class _Spent:
    """Counts the sleeps of the emulated blocks (what each phase spent, in ms)."""

    def __init__(self, monkeypatch):
        self.ms = []
        import zbpipe.bench.emulated as em

        real = em.spend
        monkeypatch.setattr(em, "spend", lambda ms, dev: (self.ms.append(ms), real(0.0, dev)))

    def take(self):
        out, self.ms = sum(self.ms), []
        return out


def test_split_backward_puts_i_and_w_where_they_belong(monkeypatch):
    spent = _Spent(monkeypatch)
    blocks = torch.nn.Sequential(EmulatedBlock(8, 1.0, 2.0, 3.0, saved_elems=16), EmulatedBlock(8, 1.0, 2.0, 3.0))
    x = torch.randn(4, 8, requires_grad=True)
    out = blocks(x)
    assert spent.take() == pytest.approx(2.0)  # two forwards
    grads, work = _C.backward_input([out], [torch.ones(4, 8)], [x])
    assert spent.take() == pytest.approx(4.0)  # both input paths, no weight path
    assert torch.equal(grads[0], torch.ones(4, 8))
    assert all(b.bias.grad is None for b in blocks)
    _C.backward_weight(work)
    assert spent.take() == pytest.approx(6.0)  # both weight paths
    for b in blocks:
        assert torch.equal(b.bias.grad, torch.full((8,), 4.0))


def test_full_backward_spends_i_plus_w(monkeypatch):
    spent = _Spent(monkeypatch)
    block = EmulatedBlock(8, 1.0, 2.0, 3.0)
    x = torch.randn(4, 8, requires_grad=True)
    out = block(x)
    spent.take()
    _C.backward_full([out], [torch.ones(4, 8)], [x])
    assert spent.take() == pytest.approx(5.0)


def test_cpu_sleep_releases_the_cpu():
    block = EmulatedBlock(4, 20.0, 0.0, 0.0)
    t0, c0 = time.perf_counter(), time.process_time()
    block(torch.randn(2, 4))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert wall >= 0.019
    assert cpu < wall / 2  # slept, not spun


def test_saved_activation_is_held_until_backward():
    block = EmulatedBlock(4, 0.0, 0.0, 0.0, saved_elems=1000)
    x = torch.randn(2, 4, requires_grad=True)
    out = block(x)
    saved = [t for t in out.grad_fn.next_functions[0][0].saved_tensors]
    assert [t.numel() for t in saved] == [1000]


def test_bad_times_raise():
    with pytest.raises(ValueError, match="i_ms"):
        EmulatedBlock(4, 1.0, -1.0, 1.0)


def test_first_stage_input_path_runs_in_w(monkeypatch):
    """An input that needs no gradient (a first stage's data): the input path still holds its
    saved buffer and spends I, in the backward's W part (I has nothing to compute there)."""
    spent = _Spent(monkeypatch)
    block = EmulatedBlock(8, 1.0, 2.0, 3.0, saved_elems=16)
    x = torch.randn(4, 8)  # no grad: the first stage's data
    out = block(x)
    assert spent.take() == pytest.approx(1.0)
    saved = [t.numel() for t in out.grad_fn.next_functions[0][0].saved_tensors]
    assert saved == [16]
    grads, work = _C.backward_input([out], [torch.ones(4, 8)], [])
    assert spent.take() == pytest.approx(0.0)
    _C.backward_weight(work)
    assert spent.take() == pytest.approx(5.0)  # the input path (2) and the weight path (3)
    assert torch.equal(block.bias.grad, torch.full((8,), 4.0))
