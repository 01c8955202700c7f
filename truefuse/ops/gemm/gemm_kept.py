"""The no-grad Linear's kept launch: ``F.linear`` routed in batch-invariant mode at decode
(``generate``'s every projection, the same call every token) in one launch from a kept record
(``ops/_launch/prepared.py``; issue 47 item 3).

Its path (``autograd/linear.py::linear``'s no-grad branch: ``plain_gemm``'s checks and kept
runner, ``bi_launch``'s layout, table tile and ``fast_launch``'s key) cost 58.7 µs of host a
decode call on an H100 host against cuBLAS ``F.linear``'s 14.4 (docs/benchmarks.md, "Eager host time
per op"). :func:`kept_linear` keeps that path's launch under a key of everything it read (the
operands' shapes, strides, dtypes, device and 16-byte alignment, the mode, the GEMM overrides and
configuration) and replays it: an output, the launch, the split bias add. The same kernel,
arguments and grid: the same bits (``tests/test_gemm_kept.py``).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from truefuse.config import get_config
from truefuse.ops._launch.prepared import KeptLaunches, launchable, stream
from truefuse.ops._launch.triton import PLAIN_TENSORS as _PLAIN
from truefuse.ops.gemm.gemm import plain_gemm
from truefuse.ops.gemm.gemm_plan import _OVERRIDES
from truefuse.ops.gemm.gemm_runners import runs_bi_triton

#: ``(go, output shape, dtype)`` by key
_KEPT = KeptLaunches()


def _on_device(x: torch.Tensor) -> bool:
    """Whether kept launches serve ``x``'s device (CUDA; tests stand the CPU in)."""
    return x.is_cuda


def _prepared(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor):
    from truefuse.ops.gemm.gemm_backends.triton import bi_prepared

    return bi_prepared(a, b, out)


def kept_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, bi: bool) -> torch.Tensor | None:
    """``x @ weight.T (+ bias)`` in batch-invariant mode where nothing records a graph: what
    ``plain_gemm(x2, weight.t(), bias, batch_invariant=True)`` gives, viewed as ``(..., N)``,
    through a kept launch where one was kept for this key, else through that path (keeping its
    launch). None where the call is not one it takes: ``bi`` False, not plain CUDA tensors of one
    dtype, an operand requiring grad with grad mode on, tracing, a dispatch mode or functorch
    transform. The caller checks that autocast casts nothing."""
    if not bi or type(x) not in _PLAIN or type(weight) not in _PLAIN or (bias is not None and type(bias) not in _PLAIN):
        return None  # fast mode's no-grad product is cuBLAS's, whose host is already stock's
    if not _on_device(x) or x.dim() < 1 or weight.dtype is not x.dtype or (bias is not None and bias.dtype is not x.dtype):
        return None
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        return None
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None or torch._C._are_functorch_transforms_active():
        return None
    xp, wp = x.data_ptr(), weight.data_ptr()
    key = (
        x.shape,
        x.stride(),
        x.dtype,
        x.get_device(),
        weight.shape,
        weight.stride(),
        weight.get_device(),
        None if bias is None else (bias.shape, bias.stride(), bias.get_device()),
        xp & 15,
        wp & 15,
        _OVERRIDES.get(),
        get_config(),
    )
    kept = _KEPT.get(key)
    if kept.__class__ is tuple:
        go, shape, dtype = kept
        if launchable(go):
            out = torch.empty(shape, dtype=dtype, device=x.device)
            op = out.data_ptr()
            if not op & 15:  # as kept (the caching allocator's blocks are 512-byte aligned)
                go(stream(go), xp, wp, op)
                if bias is not None:  # split, as the kept runner adds it (gemm_runners.py)
                    out.add_(bias)
                return out
        kept = 0
    x2 = x.reshape(-1, x.shape[-1])
    wt = weight.t()
    y2 = plain_gemm(x2, wt, bias, batch_invariant=bi)
    if kept > 0:
        go = None
        if x2.data_ptr() == xp and y2.dtype is x.dtype and runs_bi_triton(x2, wt, bias is not None):
            go = _prepared(x2, wt, y2)
        _KEPT.put(key, None if go is None else (go, (*x.shape[:-1], weight.shape[0]), y2.dtype), kept)
    return y2.view(*x.shape[:-1], weight.shape[0])


def clear() -> None:
    """Forget every kept launch (tests)."""
    _KEPT.clear()
