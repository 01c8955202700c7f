"""``truefuse.linear_cross_entropy``'s signature against torch's (issue 31, item 2) and the
predicted tokens (item 8).

torch's ``torch.nn.functional.linear_cross_entropy`` (torch ≥ 2.13): every argument it accepts
is accepted here with its default and meaning, compared against torch's own function in float64
(truefuse's PyTorch path there; the kernels' numerics are the bounded contract's business).
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

import truefuse

TORCH_LCE = getattr(F, "linear_cross_entropy", None)
needs_torch_lce = pytest.mark.skipif(TORCH_LCE is None, reason="torch has no F.linear_cross_entropy (torch < 2.13)")

N, H, V = 7, 5, 9


def _inputs(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, H, generator=g, dtype=dtype)
    W = torch.randn(V, H, generator=g, dtype=dtype)
    b = torch.randn(V, generator=g, dtype=dtype)
    cw = torch.rand(V, generator=g, dtype=dtype) + 0.5
    t = torch.randint(0, V, (N,), generator=g)
    t[2] = -100  # ignored under torch's default
    t[4] = 3
    return x, W, b, cw, t


def _run(fn, x, W, t, **kw):
    """(loss, d_input, d_weight) of ``fn`` with a random upstream for ``none``."""
    x, W = x.clone().requires_grad_(), W.clone().requires_grad_()
    loss = fn(x, W, t, **kw)
    up = torch.linspace(0.5, 1.5, loss.numel(), dtype=loss.dtype).view(loss.shape)
    dx, dW = torch.autograd.grad(loss, (x, W), up)
    return loss.detach(), dx, dW


@needs_torch_lce
def test_accepts_every_argument_of_torchs_signature():
    ours = inspect.signature(truefuse.linear_cross_entropy).parameters
    for name, p in inspect.signature(TORCH_LCE).parameters.items():
        assert name in ours, name
        assert ours[name].kind == p.kind, name
        assert ours[name].default == p.default, name  # ignore_index=None and options=None included


def _torch_options():
    return torch.nn.LinearCrossEntropyOptions(batch_chunk_size=2, chunking_method=None)


# each argument set away from its default, one at a time, and every one at once
ARGS = {
    "linear_bias": lambda b, cw: {"linear_bias": b},
    "weight": lambda b, cw: {"weight": cw},
    "reduction_sum": lambda b, cw: {"reduction": "sum"},
    "reduction_none": lambda b, cw: {"reduction": "none"},
    "ignore_index": lambda b, cw: {"ignore_index": 3},
    "ignore_index_none": lambda b, cw: {"ignore_index": None},
    "label_smoothing": lambda b, cw: {"label_smoothing": 0.2},
    "options": lambda b, cw: {"options": _torch_options()},
    "all": lambda b, cw: {
        "linear_bias": b,
        "weight": cw,
        "reduction": "sum",
        "ignore_index": 3,
        "label_smoothing": 0.2,
        "options": _torch_options(),
    },  # fmt: skip
}
# arguments whose value here is the default's meaning: the result must not change
SAME_AS_DEFAULT = {"ignore_index_none", "options"}


@needs_torch_lce
@pytest.mark.parametrize("arg", list(ARGS))
def test_each_argument_means_what_torchs_does(arg):
    x, W, b, cw, t = _inputs()
    kw = ARGS[arg](b, cw)
    if kw.get("ignore_index") not in (None, -100):
        t = t.clamp(min=0)  # -100 is a class index out of range then, for torch as for truefuse
    # torch's options= only picks how its chunked path runs, and its first call costs ~20 s of
    # CPU (a lazy set-up): torch's answer for it is its reference path's, options left out
    theirs_kw = {k: v for k, v in kw.items() if k != "options"}
    ours, theirs = _run(truefuse.linear_cross_entropy, x, W, t, **kw), _run(TORCH_LCE, x, W, t, **theirs_kw)
    for a, e in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, e)  # float64: 1e-7 relative
    default = _run(TORCH_LCE, x, W, t)
    if arg in SAME_AS_DEFAULT:
        assert all(torch.equal(a, e) for a, e in zip(theirs, default, strict=True))
    elif "reduction" not in kw:  # the argument moves torch's loss, and ours with it
        assert not torch.allclose(theirs[0], default[0])


def test_ignore_index_none_is_torchs_minus_100_and_module_takes_it():
    x, W, b, cw, t = _inputs()
    none = truefuse.linear_cross_entropy(x, W, t, ignore_index=None, reduction="none")
    assert none[2] == 0  # the -100 target is ignored, not out of range
    assert torch.equal(none, truefuse.linear_cross_entropy(x, W, t, ignore_index=-100, reduction="none"))
    module = truefuse.LinearCrossEntropyLoss(ignore_index=None, reduction="none")
    assert module.ignore_index == -100
    assert torch.equal(module(x, W, t), none)


def test_torch_arguments_bad_values_name_the_argument():
    x, W, b, cw, t = _inputs()
    with pytest.raises(TypeError, match="options must be a torch.nn.LinearCrossEntropyOptions"):
        truefuse.linear_cross_entropy(x, W, t, options={"batch_chunk_size": 2})
    if hasattr(torch.nn, "LinearCrossEntropyOptions"):
        with pytest.raises(ValueError, match="chunk_size=4 contradicts options.batch_chunk_size=2"):
            truefuse.linear_cross_entropy(x, W, t, options=_torch_options(), chunk_size=4)
    with pytest.raises(TypeError, match="ignore_index must be an int or None"):
        truefuse.linear_cross_entropy(x, W, t, ignore_index=1.5)
    with pytest.raises(TypeError, match="no class probabilities"):  # torch's float targets
        truefuse.linear_cross_entropy(x, W, torch.softmax(x @ W.T, -1))
