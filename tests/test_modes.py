"""The batch-invariant mode is read once a call and travels with it (docs/design.md §1, issue 46):
``Modes.now()`` at the forward's entry, ``ctx.modes`` for the backward. A backward run after the
``with truefuse.batch_invariant()`` block (or inside one the forward was not in) plans every GEMM in
the forward's mode, and leaves the process-wide switch as it finds it (autograd may run a backward
on its own thread while another runs a forward)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import truefuse
from truefuse.autograd._modes import Modes
from truefuse.autograd._wgrad import WgradState
from truefuse.autograd.grouped import GroupedLinearFunction, GroupSpec
from truefuse.autograd.linear import linear
from truefuse.ops.gemm import gemm_op, gemm_runners

F32 = torch.float32


def _t(*shape, seed=0, grad=True):
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F32)
    return t.requires_grad_(grad)


def test_now_reads_the_switch_into_one_of_two_kept_records():
    assert Modes.now() is Modes.now() and Modes.now().batch_invariant is False
    with truefuse.batch_invariant():
        on = Modes.now()
        assert on.batch_invariant is True and on is Modes.now()
    assert Modes.now() is not on
    with pytest.raises(dataclasses.FrozenInstanceError):
        on.batch_invariant = False


@pytest.fixture
def requests(monkeypatch):
    """Every GEMM planned from now on: (its ``batch_invariant``, the switch when it was planned).
    The plain call's kept runners are emptied so that each call plans."""
    seen = []
    real = gemm_runners.request

    def spy(*args):
        seen.append((args[10], truefuse.is_batch_invariant()))
        return real(*args)

    monkeypatch.setattr(gemm_runners, "_RUNNERS", {})
    monkeypatch.setattr(gemm_runners, "request", spy)  # the plain call's kept runners
    monkeypatch.setattr(gemm_op, "request", spy)  # the custom ops' plans
    return seen


def _linear_act(x, w, b):
    return linear(x, w, b, activation="gelu", state=WgradState(owner="test")).sum()


def _linear_plain(x, w, b):
    return linear(x, w, b, state=WgradState(owner="test")).sum()


def _grouped(x, w, b):
    spec = GroupSpec((3, 0, 4), False, True, ("w0", "w1", "w2"))
    ws, bs = [w[:, : x.shape[1]], w[:, 1 : x.shape[1] + 1], w[:, 2 : x.shape[1] + 2]], [b, b + 1, b - 1]
    return GroupedLinearFunction.apply(x, spec, WgradState(owner="test"), *ws, *bs).sum()


def _lce_none(x, w, b):
    t = torch.arange(x.shape[0]) % w.shape[0]
    return truefuse.linear_cross_entropy(x, w, t, linear_bias=b, reduction="none", chunk_size=3).sum()


def _lce_lean(x, w, b):
    t = torch.arange(x.shape[0]) % w.shape[0]
    return truefuse.linear_cross_entropy(x, w, t, linear_bias=b, memory="lean", vocab_slice=4).sum()


def _log_probs(x, w, b):
    t = torch.arange(x.shape[0]) % w.shape[0]
    return sum(o.sum() for o in truefuse.linear_log_probs(x, w, t, linear_bias=b, chunk_size=3))


def _head_logits(x, w, b):
    from truefuse.autograd._chunked_head import head_logits

    return head_logits(x, w, b).sum()


#: name -> (loss of (x (7, 5), W (6, 5) or wider, b (6,)), whether its weight gradient is planned
#: in the forward's mode too: Linear's is not, whatever the mode (docs/design.md §1: a sum over
#: the tokens, run on the fast plan))
CASES = {
    "linear_activation": (_linear_act, False),
    "linear_plain": (_linear_plain, False),
    "grouped_per_group": (_grouped, True),
    "linear_cross_entropy_none": (_lce_none, True),
    "linear_cross_entropy_lean": (_lce_lean, True),
    "linear_log_probs": (_log_probs, True),
    "head_logits": (_head_logits, True),
}


@pytest.mark.parametrize("forward_bi", [True, False])
@pytest.mark.parametrize("name", sorted(CASES))
def test_backward_plans_in_the_forwards_mode_without_the_switch(name, forward_bi, requests):
    """Forward in one mode, backward in the other: the backward's GEMMs are planned in the
    forward's mode (every one of them, or, where the weight gradient is mode-free, every other
    one), and the switch stays the backward's own meanwhile (nothing enters it there)."""
    loss_fn, wgrad_follows = CASES[name]
    x, w, b = _t(7, 5, seed=1), _t(6, 7 if name.startswith("grouped") else 5, seed=2), _t(6, seed=3)
    with truefuse.batch_invariant(forward_bi):
        loss = loss_fn(x, w, b)
    requests.clear()
    with truefuse.batch_invariant(not forward_bi):
        loss.backward()
    assert requests, "the backward planned no GEMM: the spy missed it"
    modes = [bi for bi, _ in requests]
    assert all(switch is (not forward_bi) for _, switch in requests), "the backward entered the switch"
    if wgrad_follows:
        assert all(bi is forward_bi for bi in modes), modes
    else:
        assert forward_bi in modes and all(bi is forward_bi or bi is False for bi in modes), modes
    assert x.grad is not None and w.grad is not None


def test_forward_reads_the_switch_once(monkeypatch):
    """One read a call, however many GEMMs and chunks the call runs (the chunk size and every GEMM
    agree with it): the loss over three chunks reads it once, forward and backward together."""
    import truefuse.autograd._modes as modes_mod

    reads = []
    real = modes_mod.is_batch_invariant
    monkeypatch.setattr(modes_mod, "is_batch_invariant", lambda: reads.append(1) or real())
    x, w = _t(7, 5, seed=4), _t(6, 5, seed=5)
    t = torch.arange(7) % 6
    with truefuse.batch_invariant():
        loss = truefuse.linear_cross_entropy(x, w, t, reduction="none", chunk_size=3).sum()
    loss.backward()
    assert len(reads) == 1
