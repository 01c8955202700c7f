"""RMSNorm and LayerNorm: the references, and the host launchers of the Triton kernels (their
launch tables are ``ops/norm/norm_config.py``).

``rms_norm_ref`` / ``layer_norm_ref`` state truefuse's rounding rule in plain PyTorch (fp32
statistics, one rounding of the output; see ``truefuse/kernels/norm.py``). They are the CPU path
(autograd differentiates them) and, on float64 inputs, the float64 reference of the bounded
contract. The same-dtype *baseline* of that contract is PyTorch's own ``F.rms_norm`` /
``F.layer_norm`` (``rms_norm_torch`` / ``layer_norm_torch``), which round twice in bf16 (after the
normalization and after the weight).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from truefuse.config import get_tuning
from truefuse.ops._launch.custom_op import bwd_call, custom_op, register_backward
from truefuse.ops._launch.dtypes import wide_dtype
from truefuse.ops._launch.eager_grad import eager_grads
from truefuse.ops._launch.fast_launch import fast_launch
from truefuse.ops._launch.prepared import prepare
from truefuse.ops._launch.triton import hopper, kernel_for, sm_count, traced, triton_runs
from truefuse.ops.norm.norm_config import (
    STAGED_INNER,
    block_and_warps,
    bwd_config,
    bwd_math,
    bwd_staged_config,
    fwd_programs_per_sm,
    ln_fwd_config,
    ln_fwd_staged_config,
    pdl_trigger,
    sum_config,
)


def _affine(y: torch.Tensor, weight, bias, zero_centered_gamma: bool) -> torch.Tensor:
    if weight is not None:
        w = weight.to(y.dtype)
        y = y * (w + 1 if zero_centered_gamma else w)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, *, zero_centered_gamma: bool = False
) -> torch.Tensor:
    """``x / sqrt(mean(x²) + eps) * w`` over the last dimension, in fp32, rounded once to ``x.dtype``.

    Args:
        x: (..., H), fp16 / bf16 / fp32 / fp64.
        weight: (H,) any float dtype, or None. With ``zero_centered_gamma`` the scale is ``1 + weight``.
        eps: added to the mean square.
    """
    xf = x.to(wide_dtype(x))
    rstd = 1 / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return _affine(xf * rstd, weight, None, zero_centered_gamma).to(x.dtype)


def layer_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    zero_centered_gamma: bool = False,
) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps) * w + b`` over the last dimension (biased variance), in fp32,
    rounded once to ``x.dtype``. Shapes as :func:`rms_norm_ref`; ``bias`` (H,) or None."""
    xf = x.to(wide_dtype(x))
    xc = xf - xf.mean(-1, keepdim=True)
    rstd = 1 / torch.sqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    return _affine(xc * rstd, weight, bias, zero_centered_gamma).to(x.dtype)


#: Stock Hugging Face RMSNorm forwards that ``rms_norm_hf`` reproduces bit for bit (docs/huggingface.md):
#: ``llama`` (Llama, Mistral, Qwen2/3, Qwen3-MoE, Mixtral) rounds ``x * rstd`` to x's dtype, then
#: multiplies by the weight in torch's promoted dtype (two roundings); ``gemma`` (Gemma 2/3)
#: multiplies by ``1 + weight`` in fp32 and rounds once to x's dtype.
HF_NORM_STYLES = ("llama", "gemma")


def hf_rstd(x: torch.Tensor, eps: float, *, keepdim: bool = False) -> torch.Tensor:
    """The stock modules' statistics, by their own expression (so the reduction order is torch's):
    ``rsqrt(mean(x.float()²) + eps)``, (...) fp32 with x's leading shape (``keepdim``: (..., 1), as
    the stock module keeps it)."""
    r = torch.rsqrt(x.to(torch.float32).pow(2).mean(-1, keepdim=True) + eps)
    return r if keepdim else r.squeeze(-1)


#: elements a program of ``_squares_kernel`` takes
_SQUARES_BLOCK = 4096


def hf_rstd_squared(x: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`hf_rstd`'s bits for a contiguous (M, N) ``x`` where the kernels run: the squares
    ``fp32(x)²`` in one kernel (``kernels/norm.py::_squares_kernel``), then torch's own mean of them,
    the same fp32 tensor stock's ``x.to(float32).pow(2)`` gives (torch's fp32 ``pow(2)`` is ``x * x``),
    so the same reduction and bits. For a 2-byte ``x`` that is one pass fewer than stock's cast
    then square: 6 bytes an element read and written instead of 14, before the mean's 4 (issue 48.5:
    the last H100 profile of the demo's eager step ran 1.83 ms of copies and 1.53 ms of 4-wide
    elementwise kernels, docs/results/hf/hf_profile_compile_h100_2026-11-27.txt, of which these
    casts and squares are likely most; not measured since)."""
    from truefuse.kernels.norm import _squares_kernel

    sq = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    n = x.numel()
    if n:
        fast_launch(kernel_for(_squares_kernel, sq), (-(-n // _SQUARES_BLOCK),), x, sq, n, BLOCK=_SQUARES_BLOCK)
    return torch.rsqrt(sq.mean(-1, keepdim=True) + eps).squeeze(-1)


def hf_rstd_rows(x: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`hf_rstd` of a contiguous (M, N) ``x``: by :func:`hf_rstd_squared` where that saves a
    pass (a 2-byte ``x`` the kernels take, eager mode: a compiled graph fuses stock's expression
    itself), else by stock's expression."""
    if x.dtype not in (torch.float16, torch.bfloat16) or traced(x) or torch.compiler.is_compiling():
        return hf_rstd(x, eps)
    if x.is_contiguous() and use_kernel(x):
        return hf_rstd_squared(x, eps)
    return hf_rstd(x, eps)


def hf_statistics(x: torch.Tensor, weight: torch.Tensor, eps: float, style: str, batch_invariant: bool) -> torch.Tensor:
    """The statistics ``rms_norm_hf``'s kernel applies to a contiguous (M, N) ``x``: :func:`hf_rstd`
    (stock's bits), except in batch-invariant mode (``batch_invariant``: the mode the caller read) on
    CUDA, where they are the norm kernel's (:func:`rms_norm_hf_bi`: ``1 / sqrt_rn(Σx²/N + eps)``,
    the same roundings in another summation order): torch's CUDA reduction takes its launch
    configuration from the number of rows, and with few rows splits each row's sum over more
    threads, so a row's bits changed with the batch (docs/design.md §1). On the CPU torch's row
    sums were the same bits at every row count measured (tests/test_batch_invariant.py), so
    stock's stay. (M,) fp32."""
    if kernel_statistics(x, batch_invariant):
        return rms_norm_hf_bi(x, weight, eps, style)[1]
    return hf_rstd_rows(x, eps)


def kernel_statistics(x: torch.Tensor, batch_invariant: bool) -> bool:
    """Whether ``rms_norm_hf``'s statistics over ``x`` are the norm kernel's own (batch-invariant
    mode on CUDA, where the kernel runs) rather than torch's (stock's): see :func:`hf_statistics`."""
    return x.is_cuda and batch_invariant and use_kernel(x)


def rms_norm_hf_bi(x: torch.Tensor, weight: torch.Tensor, eps: float, style: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm_hf``'s forward in batch-invariant mode in one launch: the kernel's own statistics
    applied with the stock rounding of ``style``, on a contiguous (M, N) ``x`` on CUDA. Returns y (M,
    N), dtype as :func:`rms_norm_hf_ref`'s, and rstd (M,) fp32. The mode's only statistics: without a
    gradient y is the result, with one ``rms_norm_hf_fwd_op`` applies this rstd (the same bits: the
    statistics' reduction compiles differently in another variant of the kernel, so both paths take
    them from this one; tests/test_norm.py)."""
    y, _, rstd = norm_fwd(
        x,
        weight,
        None,
        eps,
        rms=True,
        zero_centered_gamma=style == "gemma",
        round_normed=style == "llama",
        out_dtype=_hf_out_dtype(x, weight, style),
        hf_stats=True,
    )
    return y, rstd


def rms_norm_hf_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, style: str = "llama") -> torch.Tensor:
    """A transformers RMSNorm's forward, as its module writes it (the bitwise reference of ``rms_norm_hf``).

    Args:
        x: (..., H) any float dtype; the statistics are fp32 (an fp64 x is rounded to fp32, as stock does).
        weight: (H,). ``llama``: the output dtype is ``promote(x.dtype, weight.dtype)``; ``gemma``:
            the scale is ``1 + weight`` and the output has x's dtype.
        style: one of :data:`HF_NORM_STYLES`.
    """
    xf = x.to(torch.float32)  # one fp32 copy, as stock (hf_rstd's own .to is then no copy)
    # kept (..., 1) as stock keeps it: no squeeze and unsqueeze views on the path a decode step's norms
    # take (``_stock_cheaper``; 40 -> 33 µs a decode-sized call on the CPU box with the reorder there)
    h = xf * hf_rstd(xf, eps, keepdim=True)
    if style == "llama":
        return weight * h.to(x.dtype)
    return (h * (1.0 + weight.float())).type_as(x)


def rms_norm_torch(x, weight=None, eps=1e-6, *, zero_centered_gamma=False):
    """What a user without truefuse writes: ``F.rms_norm`` in ``x``'s dtype (the bounded baseline)."""
    w = weight + 1 if (weight is not None and zero_centered_gamma) else weight
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def layer_norm_torch(x, weight=None, bias=None, eps=1e-5, *, zero_centered_gamma=False):
    """``F.layer_norm`` in ``x``'s dtype (the bounded baseline)."""
    w = weight + 1 if (weight is not None and zero_centered_gamma) else weight
    return F.layer_norm(x, (x.shape[-1],), w, bias, eps)


def use_kernel(x: torch.Tensor) -> bool:
    """Whether the Triton kernels take ``x`` (else the reference runs): CUDA, or the CPU interpreter
    in fp32 only (its bf16 casts truncate, docs/design.md §8); a hidden size of at most the
    ``max_kernel_n`` tuning knob (``truefuse.config.Tuning``, 16384: a row lives in registers)."""
    return 0 < x.shape[-1] <= get_tuning().max_kernel_n and triton_runs(x)


# Programmatic dependent launch for the norm's kernels where ``_triton.hopper``: each kernel waits for
# the previous one before its first load and store, so any neighbour is safe; it hides a kernel
# boundary (0.3-2 µs of fwd + bwd, experiments/exp_norm_variants.py at d49a912).


def _fwd_staged(x: torch.Tensor, rms: bool):
    """:func:`norm_fwd`'s TMA-staged LayerNorm config for (M, N) ``x`` on Hopper, or None (the pointer kernel)."""
    return None if rms or not hopper(x) else ln_fwd_staged_config(x.shape[1], x.dtype)


def _bwd_staged(dy: torch.Tensor, x: torch.Tensor, rms: bool):
    """:func:`norm_bwd`'s TMA-staged config for 2-byte ``dy`` on Hopper, or None (the pointer kernels)."""
    return bwd_staged_config(x.shape[1], x.dtype, rms) if hopper(x) and dy.dtype.itemsize == 2 else None


def _pdl_kw(pdl: bool) -> dict:
    return {"launch_pdl": True} if pdl else {}


def norm_fwd(
    x,
    weight,
    bias,
    eps: float,
    *,
    rms: bool,
    zero_centered_gamma: bool,
    rstd=None,
    round_normed=False,
    out_dtype=None,
    hf_stats=False,
    residual=None,
    summed=None,
):
    """Launch the forward kernel on a contiguous (M, N) ``x``.

    ``rstd`` (M,) fp32, given: the kernel takes it instead of its own statistics (RMSNorm only);
    ``round_normed`` then rounds ``x * rstd`` to x's dtype before the weight; ``hf_stats``: the
    kernel's own statistics applied as a given rstd is (``rms_norm_hf_bi``); ``out_dtype``: y's
    dtype (default x's). ``residual`` (M, N) like x, with ``summed`` (M, N) x's dtype to write:
    the kernel norms ``residual + x`` rounded to x's dtype and writes that sum to ``summed``
    (``ops/norm/add_norm.py``). Returns ``(y, mean, rstd)``: y (M, N); mean (M,) fp32 (None for
    RMSNorm); rstd (M,) fp32.
    """

    M, N = x.shape
    y = torch.empty_like(x, dtype=out_dtype or x.dtype)
    rstd_in = rstd is not None
    if (rstd_in or hf_stats) and not rms:
        raise ValueError("a given rstd or hf_stats is for RMSNorm only")
    if (residual is None) != (summed is None) or (residual is not None and rstd_in):
        raise ValueError("residual and summed come together, and not with a given rstd (it is the sum's)")
    if rstd is None:
        rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    mean = None if rms else torch.empty(M, dtype=torch.float32, device=x.device)
    if M == 0:
        return y, mean, rstd
    pdl = hopper(x) and not traced(x)  # Hopper; not in a compiled graph (a launch attribute: the same bits)
    staged = _fwd_staged(x, rms) if residual is None else None
    if staged is not None:
        ln_fwd_staged(x, weight, bias, eps, zero_centered_gamma, y, mean, rstd, staged, pdl)
        return y, mean, rstd
    kernel, grid, args, kwargs = _fwd_launch(
        x, weight, bias, y, mean, rstd, eps, rms, zero_centered_gamma, rstd_in, round_normed, hf_stats, residual, summed, pdl
    )
    fast_launch(kernel, grid, *args, **kwargs)
    return y, mean, rstd


def _fwd_launch(
    x, weight, bias, y, mean, rstd, eps, rms, zero_centered_gamma, rstd_in, round_normed, hf_stats, residual, summed, pdl
) -> tuple:
    """The forward kernel (the register-row one), grid, arguments and keywords of :func:`norm_fwd`
    (and :func:`hf_prepared`)."""
    from truefuse.kernels.norm import _norm_fwd_kernel

    M, N = x.shape
    block, warps = block_and_warps(N)
    per_sm, wb = fwd_programs_per_sm(N), "reg"
    if not rms:
        warps, per_sm, wb = ln_fwd_config(N)
    per_sm = per_sm if x.is_cuda else 0
    programs = min(M, per_sm * sm_count(x.device.index or 0)) if per_sm else M
    args = (
        x,
        weight if weight is not None else x,
        bias if bias is not None else x,
        y,
        mean if mean is not None else rstd,
        rstd,
        x.stride(0),
        y.stride(0),
        N,
        float(eps),
    )
    kwargs = dict(
        IS_RMS=rms,
        HAS_W=weight is not None,
        HAS_B=bias is not None,
        ZERO_CENTERED=zero_centered_gamma,
        BLOCK_N=block,
        RSTD_IN=rstd_in,
        ROUND_NORMED=bool(round_normed),
        M=M,
        PERSISTENT=bool(per_sm),
        # named though it is the default: Dynamo traces this launch itself where no op wraps it
        # (rms_norm_hf's batch-invariant statistics, hf_statistics) and records only the arguments
        # named; Inductor's launcher then still expects an unnamed constexpr as a positional
        # argument, and the call misses its last grid argument ("launcher() missing 1 required
        # positional argument: '_grid_2'", issue 47; torch 2.11 / 2.13)
        EVICT="",
        PDL=pdl and pdl_trigger("fwd", N, rms),
        WB=wb,
        HF_STATS=bool(hf_stats) and not rstd_in,
        r_ptr=x if residual is None else residual,
        s_ptr=y if summed is None else summed,
        stride_r=0 if residual is None else residual.stride(0),
        stride_s=0 if summed is None else summed.stride(0),
        HAS_RES=residual is not None,
        num_warps=warps,
        **_pdl_kw(pdl),
    )
    return kernel_for(_norm_fwd_kernel, y), (programs,), args, kwargs


def hf_prepared(x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor, eps: float, style: str, bi: bool):
    """The launch ``rms_norm_hf`` just made on a contiguous (M, N) ``x`` (M not 0) into ``y``, kept
    whole: ``go(stream, x, weight, y, rstd)`` (addresses), or what ``ops/_launch/prepared.py::prepare``
    says instead. ``bi``: :func:`rms_norm_hf_bi`'s, which writes ``rstd`` too; else
    ``rms_norm_hf_fwd_op``'s, which applies the given ``rstd`` (the register-row kernel either way,
    RMSNorm's only one)."""
    kernel, grid, args, kwargs = _fwd_launch(
        x, weight, None, y, None, rstd, eps if bi else 0.0, rms=True, zero_centered_gamma=style == "gemma",
        rstd_in=not bi, round_normed=style == "llama", hf_stats=bi, residual=None, summed=None,
        pdl=hopper(x) and not traced(x),
    )  # fmt: skip
    return prepare((x, weight, y, rstd), kernel, grid, *args, **kwargs)


def _tma_aligned(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy where its base is not 16-byte aligned (a TMA descriptor's requirement)."""
    return t.clone() if t.data_ptr() % 16 else t


def ln_fwd_staged(x, weight, bias, eps: float, zero_centered_gamma: bool, y, mean, rstd, cfg, pdl: bool = False):
    """Launch the TMA-staged LayerNorm forward (``cfg``: :func:`ln_fwd_staged_config`) on a
    contiguous (M, N) ``x``, M > 0, writing ``y``, ``mean`` and ``rstd``. A base that is not
    16-byte aligned (a TMA requirement) is copied first: the same values, the same bits."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from truefuse.kernels.norm import _ln_fwd_staged_kernel

    M, N = x.shape
    warps, per_sm, stages = cfg
    block = block_and_warps(N)[0]
    x = _tma_aligned(x)
    programs = min(M, per_sm * sm_count(x.device.index or 0) if x.is_cuda else 4)
    _ln_fwd_staged_kernel[(programs,)](  # never traced: a host TMA descriptor (_fwd_traceable)
        TensorDescriptor.from_tensor(x, [1, block]),
        weight if weight is not None else x,
        bias if bias is not None else x,
        y,
        mean,
        rstd,
        y.stride(0),
        M,
        N,
        float(eps),
        HAS_W=weight is not None,
        HAS_B=bias is not None,
        ZERO_CENTERED=zero_centered_gamma,
        BLOCK_N=block,
        STAGES=stages,
        PDL=pdl and pdl_trigger("fwd", N, False),
        num_warps=warps,
        **_pdl_kw(pdl),
    )


def norm_bwd(dy, x, weight, bias, mean, rstd, *, rms: bool, zero_centered_gamma: bool, dres=None):
    """Launch the backward kernel; ``dy`` and ``x`` contiguous (M, N).

    ``dres`` (M, N) contiguous, or None: a gradient added to dx in fp32 before its one rounding (the
    residual stream's, ``ops/norm/add_norm.py``).

    Returns ``(dx, dweight, dbias)``: dx in ``x.dtype``; dweight / dbias (N,) summed in fp32 from
    per-program partials and rounded once to the parameter's dtype (None where there is no weight / bias).
    """
    from truefuse.kernels.norm import _norm_bwd_kernel, _norm_bwd_split_kernel

    M, N = x.shape
    dx = torch.empty_like(x)
    block, _ = block_and_warps(N)
    pdl = hopper(x) and not traced(dx)  # Hopper; not in a compiled graph (the same bits)
    cfg = bwd_config(N, rms)
    staged = _bwd_staged(dy, x, rms)
    warps, rows, per_sm = (cfg.warps, cfg.rows, cfg.per_sm) if staged is None else (staged[0], 1, staged[1])
    programs = max(1, min(M, per_sm * sm_count(x.device.index or 0) if x.is_cuda else 4))
    # whole tiles per program; then only as many programs as that takes
    per_program = -(M // -programs)
    rows_per_program = -(per_program // -rows) * rows
    programs = max(1, -(-M // rows_per_program)) if M else 1
    has_w, has_bias = weight is not None, bias is not None
    dw_part = torch.empty((programs, N), dtype=torch.float32, device=x.device) if has_w else None
    db_part = torch.empty((programs, N), dtype=torch.float32, device=x.device) if has_bias else None
    if M == 0:
        return dx, (torch.zeros_like(weight) if has_w else None), (torch.zeros_like(bias) if has_bias else None)
    if dres is not None and (dres.shape != x.shape or dres.stride(1) != 1):
        raise ValueError(f"dres must be ({M}, {N}) with contiguous rows, got {tuple(dres.shape)} strides {dres.stride()}")
    tail = (
        weight if has_w else x,
        mean if mean is not None else rstd,
        rstd,
        dx,
        dw_part if has_w else rstd,
        db_part if has_bias else rstd,
    )
    flags = dict(
        IS_RMS=rms,
        HAS_W=has_w,
        HAS_B=has_bias,
        ZERO_CENTERED=zero_centered_gamma,
        PDL=pdl and pdl_trigger("bwd", N, rms),
        dres_ptr=dx if dres is None else dres,
        stride_dres=0 if dres is None else dres.stride(0),
        HAS_DRES=dres is not None,
        num_warps=warps,
        **_pdl_kw(pdl),
    )
    math = bwd_math(N, rms)  # the staged and two-part kernels' (the pointer kernel has neither choice)
    args = (dy, x, *tail, dy.stride(0), x.stride(0), dx.stride(0), M, N, rows_per_program)
    if staged is not None:
        bwd_staged(dy, x, tail, M, N, rows_per_program, programs, staged, {**flags, **math})
    elif cfg.parts is None:
        fast_launch(
            kernel_for(_norm_bwd_kernel, dx), (programs,), *args, **flags, BLOCK_N=block, ROWS=cfg.rows, PREFETCH=cfg.prefetch
        )
    else:
        a, b = cfg.parts
        kernel = kernel_for(_norm_bwd_split_kernel, dx)
        fast_launch(kernel, (programs,), *args, **flags, **math, BLOCK_A=a, BLOCK_B=b, PREFETCH=cfg.prefetch)
    if has_w and has_bias:
        dw, db = _sum_partials(dw_part, weight.dtype, pdl, db_part, bias.dtype)
    else:
        dw = _sum_partials(dw_part, weight.dtype, pdl)[0] if has_w else None
        db = _sum_partials(db_part, bias.dtype, pdl)[0] if has_bias else None
    return dx, dw, db


def bwd_staged(dy, x, tail, M: int, N: int, rows_per_program: int, programs: int, cfg, flags: dict) -> None:
    """Launch ``_norm_bwd_staged_kernel`` (``cfg``: :func:`bwd_staged_config`) on contiguous (M, N)
    ``dy`` and ``x`` (2-byte, H % 64 == 0); ``tail``: the pointer arguments after them (w, mean,
    rstd, dx, dw / db partials). A base that is not 16-byte aligned (a TMA requirement) is copied
    first: the same values, the same bits."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from truefuse.kernels.norm import _norm_bwd_staged_kernel

    block, inner = block_and_warps(N)[0], STAGED_INNER
    x, dy = _tma_aligned(x), _tma_aligned(dy)
    descs = [TensorDescriptor.from_tensor(t.view(M, N // inner, inner), [1, block // inner, inner]) for t in (x, dy)]
    dx = tail[3]
    _norm_bwd_staged_kernel[(programs,)](  # never traced: a host TMA descriptor (_bwd_traceable)
        *descs, *tail, dx.stride(0), M, N, rows_per_program, **flags, BLOCK_N=block, STAGES=cfg[2], INNER=inner
    )


def _sum_partials(part: torch.Tensor, dtype: torch.dtype, pdl: bool = False, part2=None, dtype2=None) -> tuple:
    """Column sums of the (programs, N) fp32 partials, in program order, rounded once to ``dtype``;
    with ``part2`` (the same shape) its sums too, in the same launch (one kernel boundary fewer):
    ``(out, out2 or None)``."""
    from truefuse.kernels.norm import _sum_partials_kernel

    P, N = part.shape
    out = torch.empty(N, dtype=dtype, device=part.device)
    out2 = None if part2 is None else torch.empty(N, dtype=dtype2, device=part.device)
    block_p, block, warps = sum_config(N, part2 is not None)
    if not part.is_cuda:  # the CPU interpreter: each column's sum is the same at any BLOCK_N, and each program costs its Python
        block = max(block, 256)
    fast_launch(
        kernel_for(_sum_partials_kernel, out),
        (-(-N // block),),
        part,
        out,
        part if part2 is None else part2,
        out if out2 is None else out2,
        P,
        N,
        BLOCK_P=block_p,
        BLOCK_N=block,
        TWO=part2 is not None,
        PDL=pdl,
        num_warps=warps,
        **_pdl_kw(pdl),
    )
    return out, out2


# ---------------------------------------------------------------------------------------------
# torch.library custom ops (docs/design.md §6.7): opaque to torch.compile, with fake implementations and
# the backward registered on the op. Optional outputs are empty tensors (an op returns no None).


def _fwd_traceable(x, weight, bias, eps, rms, zero_centered_gamma) -> bool:
    """Whether a compiled graph may take ``norm_fwd``'s kernel itself (``_launch/custom_op.py::custom_op``'s
    ``inline``): not the TMA-staged LayerNorm forward, whose host-side descriptor torch 2.11
    cannot trace; that call stays one opaque op, with eager mode's bits."""
    return _fwd_staged(x, rms) is None


def _bwd_traceable(dy, x, weight, bias, mean, rstd, rms, zero_centered_gamma) -> bool:
    """:func:`_fwd_traceable` for ``norm_bwd``: not the TMA-staged backward."""
    return _bwd_staged(dy, x, rms) is None


@custom_op("truefuse::norm_fwd", mutates_args=(), inline=_fwd_traceable)
def norm_fwd_op(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, rms: bool, zero_centered_gamma: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``norm_fwd`` as an op: ``(y, mean or empty, rstd)`` for a contiguous (M, N) ``x``."""
    y, mean, rstd = norm_fwd(x, weight, bias, eps, rms=rms, zero_centered_gamma=zero_centered_gamma)
    return y, (rstd.new_empty(0) if mean is None else mean), rstd


@norm_fwd_op.register_fake
def _(x, weight, bias, eps, rms, zero_centered_gamma):
    M = x.shape[0]
    f32 = torch.float32
    return torch.empty_like(x), x.new_empty((0,) if rms else (M,), dtype=f32), x.new_empty((M,), dtype=f32)


@custom_op("truefuse::norm_bwd", mutates_args=(), inline=_bwd_traceable)
def norm_bwd_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    rms: bool,
    zero_centered_gamma: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``norm_bwd`` as an op: ``(dx, dweight or empty, dbias or empty)``."""
    dx, dw, db = norm_bwd(
        dy.contiguous(), x, weight, bias, None if rms else mean, rstd, rms=rms, zero_centered_gamma=zero_centered_gamma
    )
    # a fresh empty tensor for each missing output: a custom op's outputs may not alias each other
    return dx, (x.new_empty(0) if dw is None else dw), (x.new_empty(0) if db is None else db)


@norm_bwd_op.register_fake
def _(dy, x, weight, bias, mean, rstd, rms, zero_centered_gamma):
    return (
        torch.empty_like(x),
        x.new_empty(0) if weight is None else torch.empty_like(weight),
        x.new_empty(0) if bias is None else torch.empty_like(bias),
    )


def _norm_setup(ctx, inputs, output):
    x, weight, bias, _eps, rms, zero_centered_gamma = inputs
    _, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    # no zero-filled gradients for mean and rstd: each fill is a kernel of its own in every
    # backward (~1-2 µs of a 25 µs forward + backward at 8192 x 1024; tests/test_norm.py)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, weight, bias, mean, rstd)
    ctx.rms, ctx.zero_centered_gamma = rms, zero_centered_gamma


def _norm_backward(ctx, dy, _dmean, _drstd):
    if dy is None:  # nothing flowed into y (grads are not materialized): no gradient
        return None, None, None, None, None, None
    x, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dw, db = bwd_call(ctx, norm_bwd_op, dy, x, weight, bias, mean, rstd, ctx.rms, ctx.zero_centered_gamma)
    return dx, (None if weight is None else dw), (None if bias is None else db), None, None, None


def _norm_names(inputs) -> tuple[str, str]:
    """The public op behind a ``norm_bwd`` call, for its double-backward refusal (``rms`` is its
    7th input; ``rms_norm_hf`` and ``RMSNorm`` are ``rms_norm`` there)."""
    return _norm_op_names(inputs[6])


def _norm_op_names(rms: bool) -> tuple[str, str]:
    op = "rms_norm" if rms else "layer_norm"
    return op, f"truefuse.ops.norm.norm.{op}_ref"


register_backward(
    norm_fwd_op,
    _norm_backward,
    _norm_setup,
    bwd_ops=(norm_bwd_op,),
    name=_norm_names,
    eager_names=lambda ctx: _norm_op_names(ctx.rms),
)


# The stock-rounding RMSNorm (``rms_norm_hf``): the statistics come in (torch's, for their bits),
# the kernel applies them and the weight; the backward is the norm's own with that rstd.


@custom_op("truefuse::rms_norm_hf_fwd", mutates_args=(), inline=True)
def rms_norm_hf_fwd_op(x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, style: str) -> torch.Tensor:
    """y of :func:`rms_norm_hf_ref` for a contiguous (..., N) ``x`` and its (M,) fp32 ``rstd``
    (``hf_rstd`` of its M rows). Flattened to rows here, inside the op: a reshape outside it and
    the view back were two autograd nodes a forward + backward (docs/benchmarks.md, "Eager host
    time per op")."""
    y, _, _ = norm_fwd(
        x.reshape(-1, x.shape[-1]),
        weight,
        None,
        0.0,
        rms=True,
        zero_centered_gamma=style == "gemma",
        rstd=rstd,
        round_normed=style == "llama",
        out_dtype=_hf_out_dtype(x, weight, style),
    )
    return y.view(x.shape)


def _hf_out_dtype(x, weight, style: str) -> torch.dtype:
    return torch.promote_types(x.dtype, weight.dtype) if style == "llama" else x.dtype


@rms_norm_hf_fwd_op.register_fake
def _(x, weight, rstd, style):
    return torch.empty_like(x, dtype=_hf_out_dtype(x, weight, style))


def _hf_setup(ctx, inputs, output):
    x, weight, rstd, style = inputs
    ctx.save_for_backward(x, weight, rstd)
    ctx.zero_centered_gamma = style == "gemma"


def _hf_backward(ctx, dy):
    x, weight, rstd = ctx.saved_tensors
    N = x.shape[-1]
    dy2, x2 = dy.reshape(-1, N), x.reshape(-1, N)  # the rows, as the forward flattened them
    dx, dw, _ = bwd_call(ctx, norm_bwd_op, dy2, x2, weight, None, rstd.new_empty(0), rstd, True, ctx.zero_centered_gamma)
    return dx.view(x.shape), dw, None, None


# its double-backward refusal: norm_bwd_op's, which names rms_norm (the eager path names the same)
register_backward(rms_norm_hf_fwd_op, _hf_backward, _hf_setup, eager_names=lambda ctx: _norm_op_names(True))


# ``rms_norm_hf``'s PyTorch path as one opaque op while torch.compile traces a batch-invariant model
# off CUDA (autograd/norm.py): traced into the graph, Inductor fuses the mean and rsqrt into other
# roundings (1 ulp on the CPU, torch 2.13), and a batch-invariant model's compiled bits must be its
# eager ones (tests/hf/test_bi_compile.py). The op runs the stock expression; its backward
# recomputes it and takes autograd's gradients, eager's bits too.
@custom_op("truefuse::rms_norm_hf_pytorch_fwd", mutates_args=())
def rms_norm_hf_pytorch_op(x: torch.Tensor, weight: torch.Tensor, eps: float, style: str) -> torch.Tensor:
    """:func:`rms_norm_hf_ref` (contiguous)."""
    return rms_norm_hf_ref(x, weight, eps, style=style).contiguous()


@rms_norm_hf_pytorch_op.register_fake
def _(x, weight, eps, style):
    return torch.empty_like(x, dtype=_hf_out_dtype(x, weight, style), memory_format=torch.contiguous_format)


@custom_op("truefuse::rms_norm_hf_pytorch_bwd", mutates_args=())
def rms_norm_hf_pytorch_bwd_op(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, style: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """dx, dweight (contiguous): autograd's, through the recomputed stock expression."""
    return eager_grads(lambda x, w: rms_norm_hf_ref(x, w, eps, style=style), (x, weight), dy)


@rms_norm_hf_pytorch_bwd_op.register_fake
def _(dy, x, weight, eps, style):
    cf = torch.contiguous_format
    return torch.empty_like(x, memory_format=cf), torch.empty_like(weight, memory_format=cf)


def _hf_pytorch_setup(ctx, inputs, output):
    x, weight, eps, style = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps, ctx.style = eps, style


def _hf_pytorch_backward(ctx, dy):
    x, weight = ctx.saved_tensors
    dx, dw = rms_norm_hf_pytorch_bwd_op(dy, x, weight, ctx.eps, ctx.style)
    return dx, dw, None, None


register_backward(
    rms_norm_hf_pytorch_op,
    _hf_pytorch_backward,
    _hf_pytorch_setup,
    bwd_ops=(rms_norm_hf_pytorch_bwd_op,),
    name="rms_norm_hf",
    ref="truefuse.ops.norm.norm.rms_norm_hf_ref",
)
