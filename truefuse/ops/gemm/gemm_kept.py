"""The batch-invariant Linear's kept launches: ``F.linear`` routed in batch-invariant mode at decode
(``generate``'s every projection, the same call every token), and the forward and input-gradient
products of a training step's routed linear (the same shapes every step), each in one launch from
a kept record (``ops/_launch/prepared.py``; issue 47 item 3).

Its path (``autograd/linear.py::linear``'s no-grad branch: ``plain_gemm``'s checks and kept
runner, ``bi_launch``'s layout, table tile and ``fast_launch``'s key) cost 58.7 µs of host a
decode call on an H100 host against cuBLAS ``F.linear``'s 14.4 (docs/benchmarks.md, "Eager host time
per op"). :func:`kept_product` keeps that path's launch under a key of everything it read (the
operands' shapes, strides, dtypes, devices and 16-byte alignment, the GEMM overrides and
configuration; only batch-invariant mode keeps) and replays it: an output, the launch, the split
bias add. The same kernel, arguments and grid: the same bits (``tests/test_kept_launches.py``).
"""

from __future__ import annotations

import torch

from truefuse.ops._launch.prepared import KeptLaunches, launchable, layout, replayable, stream
from truefuse.ops.gemm.gemm import checked_plain_gemm, plain_gemm
from truefuse.ops.gemm.gemm_plan import plan_settings
from truefuse.ops.gemm.gemm_runners import runs_bi_triton

#: ``(go,)`` by key
_KEPT = KeptLaunches()


def _prepared(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor):
    from truefuse.ops.gemm.gemm_backends.triton import bi_prepared

    return bi_prepared(a, b, out)


def kept_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, bi: bool) -> torch.Tensor | None:
    """``x @ weight.T (+ bias)`` in batch-invariant mode where nothing records a graph: what
    ``plain_gemm(x2, weight.t(), bias, batch_invariant=True)`` gives, viewed as ``(..., N)``, by the
    launch kept for this call (keeping the path's launch where none is yet). None where the call is
    not one it takes: ``bi`` False (fast mode's no-grad product is cuBLAS's, whose host is already
    stock's), not tensors of one dtype a kept launch may serve (``prepared.replayable``). The caller
    checks that autocast casts nothing."""
    key = _linear_key(x, weight, bias, bi)
    if key is None:
        return None
    kept = _KEPT.get(key)
    if kept.__class__ is tuple:
        y = _replay(kept, x, weight, bias)
        if y is not None:
            return y
        kept = 0
    x2 = x.reshape(-1, x.shape[-1])
    wt = weight.t()
    y2 = plain_gemm(x2, wt, bias, batch_invariant=True)
    if kept > 0:  # the kept launch takes x's own address: where the reshape made no copy
        fits = x2.data_ptr() == x.data_ptr() and y2.dtype is x.dtype and runs_bi_triton(x2, wt, bias is not None)
        _KEPT.put(key, kept, _prepared(x2, wt, y2) if fits else None, (*x.shape[:-1], weight.shape[0]))
    return y2.view(*x.shape[:-1], weight.shape[0])


def kept_linear_hit(x, weight, bias, bi: bool) -> torch.Tensor | None:
    """:func:`kept_linear`'s result where a launch is kept for this call, else None (nothing run):
    the routed ``F.linear``'s first try at decode, before its own checks
    (``integrations/huggingface/batch_invariant.py``; any ``x`` and ``weight``, checked here)."""
    key = _linear_key(x, weight, bias, bi)
    kept = None if key is None else _KEPT.get(key)
    return _replay(kept, x, weight, bias) if kept.__class__ is tuple else None


def _linear_key(x, weight, bias, bi: bool) -> tuple | None:
    """A :func:`kept_linear` call's key: everything its path reads (x's and the weight's layouts,
    the bias's, the plan's settings), where a kept launch may serve it; else None."""
    if not bi or not replayable(x, weight, bias) or x.dim() < 1:
        return None
    if weight.dtype is not x.dtype or (bias is not None and bias.dtype is not x.dtype):
        return None
    return ("linear", layout(x, x.data_ptr()), layout(weight, weight.data_ptr()), _bias_key(bias), plan_settings())


def _replay(kept: tuple, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``kept``'s launch (an entry: ``go`` and the output's shape) on ``x`` and ``weight`` (or a
    product's ``a`` and ``b``) into a fresh output, the bias added as the kept runner adds it (split:
    gemm_runners.py); None where it may not launch now."""
    go, shape = kept
    if not launchable(go):
        return None
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    op = out.data_ptr()
    if op & 15:  # as kept (the caching allocator's blocks are 512-byte aligned)
        return None
    go(stream(go), x.data_ptr(), weight.data_ptr(), op)
    if bias is not None:
        out.add_(bias)
    return out


def kept_product(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, bi: bool) -> torch.Tensor:
    """``checked_plain_gemm(a, b, bias, a.dtype, bi)`` (the caller checked what it asks), through the
    launch kept for this call's key in batch-invariant mode where a kept launch may serve it; else
    through that path (the Linear Function's forward and input gradient)."""
    if not bi or not replayable(a, b, bias):
        return checked_plain_gemm(a, b, bias, a.dtype, bi)
    return _product(a, b, bias)


def _product(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The batch-invariant product through its kept launch, else through its path (the caller
    checked what ``checked_plain_gemm`` asks), keeping its launch (the plain batch-invariant Triton
    product)."""
    key = (layout(a, a.data_ptr()), layout(b, b.data_ptr()), _bias_key(bias), plan_settings())
    kept = _KEPT.get(key)
    if kept.__class__ is tuple:
        out = _replay(kept, a, b, bias)
        if out is not None:
            return out
        kept = 0
    out = checked_plain_gemm(a, b, bias, a.dtype, True)
    if kept > 0:
        go = _prepared(a, b, out) if out.dtype is a.dtype and runs_bi_triton(a, b, bias is not None) else None
        _KEPT.put(key, kept, go, out.shape)
    return out


def _bias_key(bias: torch.Tensor | None) -> tuple | None:
    """The bias's part of a key (the path checks its shape)."""
    return None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.get_device())


def clear() -> None:
    """Forget every kept launch (tests)."""
    _KEPT.clear()
