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
    },
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


# --- predicted tokens (item 8) ---------------------------------------------------------------------


def _tie_inputs():
    """Small integers (every logit exact in fp32) with exact ties: token 0's maximum is shared by
    classes 3, 40 and 66 (another kernel block at BLOCK_V = 64, the last, partial one)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-2, 3, (2, 4, H), generator=g).float()
    W = torch.randint(-1, 2, (70, H), generator=g).float()
    x[0, 0] = 1.0
    W[3] = W[40] = W[66] = 3.0  # 15 against at most 10 elsewhere
    t = torch.randint(0, 70, (2, 4), generator=g)
    t[0, 1] = t[1, 2] = -100
    return x, W, t


@pytest.mark.parametrize("memory", ["default", "lean"])
def test_predicted_tokens_are_torch_argmax_of_the_logits(memory):
    x, W, t = _tie_inputs()
    kw = {"memory": memory, "vocab_slice": 32, "chunk_size": 4, "return_predicted_tokens": True}
    xl, Wl = x.clone().requires_grad_(), W.clone().requires_grad_()
    out = truefuse.linear_cross_entropy(xl, Wl, t, softcap=30.0, **kw)
    ref = truefuse.linear_cross_entropy_ref(x, W, t, softcap=30.0, return_predicted_tokens=True)
    expect = (30.0 * torch.tanh((x @ W.T) / 30.0)).argmax(-1)
    assert out.predicted_tokens.dtype == torch.int64 and out.predicted_tokens.shape == t.shape
    assert torch.equal(ref.predicted_tokens, expect)
    assert torch.equal(out.predicted_tokens, expect)  # ignored tokens (t = -100) included
    assert out.predicted_tokens[0, 0] == 3  # the lowest index among the tied maxima
    assert not out.predicted_tokens.requires_grad
    # asking for them changes neither the loss nor the gradients
    out.loss.backward()
    xp, Wp = x.clone().requires_grad_(), W.clone().requires_grad_()
    plain = truefuse.linear_cross_entropy(xp, Wp, t, softcap=30.0, **{**kw, "return_predicted_tokens": False})
    plain.backward()
    assert torch.equal(out.loss, plain) and torch.equal(xl.grad, xp.grad) and torch.equal(Wl.grad, Wp.grad)


def test_predicted_tokens_pytorch_path_and_module():
    x, W, t = _tie_inputs()
    x, W = x.double(), W.double()  # fp64: the PyTorch chunk math, not the kernel
    expect = (x @ W.T).argmax(-1)
    out = truefuse.linear_cross_entropy(x, W, t, reduction="none", return_predicted_tokens=True)
    assert torch.equal(out.predicted_tokens, expect) and out.z_loss is None and out.token_accuracy is None
    module = truefuse.LinearCrossEntropyLoss(return_predicted_tokens=True)
    assert torch.equal(module(x, W, t).predicted_tokens, expect)
    valid = t != -100
    acc = truefuse.linear_cross_entropy(x, W, t, return_token_accuracy=True).token_accuracy
    assert acc == ((expect == t) & valid).sum() / valid.sum()  # the accuracy is the same argmax


def test_token_scaling_is_a_recipe_over_reduction_none():
    """Liger's ``use_token_scaling`` (the DFT loss: each token's loss times its target's predicted
    probability, detached) is not an option here: with ``reduction="none"`` it is
    ``(ce * ce.detach().neg().exp())`` (p_t = e^(−ce) without label smoothing, z-loss or class
    weights), which docs/linear_cross_entropy.md gives. This checks the recipe against the
    definition, loss and gradients, in float64."""
    x, W, b, cw, t = _inputs()
    valid = t != -100

    def recipe(x, W, t):
        ce = truefuse.linear_cross_entropy(x, W, t, reduction="none")
        return (ce * ce.detach().neg().exp()).sum() / valid.sum()

    def definition(x, W, t):
        logits = x @ W.T
        p_t = torch.softmax(logits, -1).gather(1, t.clamp(min=0)[:, None]).squeeze(1).detach()
        ce = F.cross_entropy(logits, t, reduction="none")
        return (ce * p_t * valid).sum() / valid.sum()

    for a, e in zip(_run(recipe, x, W, t), _run(definition, x, W, t), strict=True):
        torch.testing.assert_close(a, e)
