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
from torch.utils._python_dispatch import _get_current_dispatch_mode

from truefuse.config import get_config
from truefuse.ops._launch.prepared import KeptLaunches, launchable, stream
from truefuse.ops._launch.triton import PLAIN_TENSORS as _PLAIN
from truefuse.ops.gemm.gemm import checked_plain_gemm, plain_gemm
from truefuse.ops.gemm.gemm_plan import _OVERRIDES
from truefuse.ops.gemm.gemm_runners import runs_bi_triton

#: ``(go,)`` by key
_KEPT = KeptLaunches()


def _on_device(x: torch.Tensor) -> bool:
    """Whether kept launches serve ``x``'s device (CUDA; tests stand the CPU in)."""
    return x.is_cuda


def _prepared(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor):
    from truefuse.ops.gemm.gemm_backends.triton import bi_prepared

    return bi_prepared(a, b, out)


def kept_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, bi: bool) -> torch.Tensor | None:
    """``x @ weight.T (+ bias)`` in batch-invariant mode where nothing records a graph: what
    ``plain_gemm(x2, weight.t(), bias, batch_invariant=True)`` gives, viewed as ``(..., N)``, by
    :func:`kept_product`. None where the call is not one it takes: ``bi`` False, not plain CUDA
    tensors of one dtype, an operand requiring grad with grad mode on, tracing, a dispatch mode or
    functorch transform. The caller checks that autocast casts nothing."""
    if not bi or type(x) not in _PLAIN or type(weight) not in _PLAIN or (bias is not None and type(bias) not in _PLAIN):
        return None  # fast mode's no-grad product is cuBLAS's, whose host is already stock's
    if not _on_device(x) or x.dim() < 1 or weight.dtype is not x.dtype or (bias is not None and bias.dtype is not x.dtype):
        return None
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        return None
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return None
    y2 = kept_product(x.reshape(-1, x.shape[-1]), weight.t(), bias, True, checked=False)
    return y2.view(*x.shape[:-1], weight.shape[0])


def kept_product(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, bi: bool, *, checked: bool = True) -> torch.Tensor:
    """``checked_plain_gemm(a, b, bias, a.dtype, bi)`` (``checked``: the caller checked what it
    asks; else ``plain_gemm``'s checks run where no launch is kept for the key), through the launch
    kept for this call's key in batch-invariant mode on CUDA; else through that path, keeping its
    launch (the plain batch-invariant Triton product: the Linear's forward and input gradient)."""
    if not bi or not _on_device(a) or _get_current_dispatch_mode() is not None:
        return _path(a, b, bias, bi, checked)
    ap, bp = a.data_ptr(), b.data_ptr()
    key = (a.shape, a.stride(), a.dtype, a.get_device(), b.shape, b.stride(), b.dtype, b.get_device(), ap & 15, bp & 15)
    bias_key = None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.get_device())  # the path checks its shape
    key = (*key, bias_key, _OVERRIDES.get(), get_config())
    kept = _KEPT.get(key)
    if kept.__class__ is tuple:
        (go,) = kept
        if launchable(go):
            out = torch.empty((a.shape[0], b.shape[1]), dtype=a.dtype, device=a.device)
            op = out.data_ptr()
            if not op & 15:  # as kept (the caching allocator's blocks are 512-byte aligned)
                go(stream(go), ap, bp, op)
                if bias is not None:  # split, as the kept runner adds it (gemm_runners.py)
                    out.add_(bias)
                return out
        kept = 0
    out = _path(a, b, bias, bi, checked)
    if kept > 0:
        go = _prepared(a, b, out) if out.dtype is a.dtype and runs_bi_triton(a, b, bias is not None) else None
        _KEPT.put(key, kept, go)
    return out


def _path(a, b, bias, bi: bool, checked: bool) -> torch.Tensor:
    if checked:
        return checked_plain_gemm(a, b, bias, a.dtype, bi)
    return plain_gemm(a, b, bias, batch_invariant=bi)


def clear() -> None:
    """Forget every kept launch (tests)."""
    _KEPT.clear()
