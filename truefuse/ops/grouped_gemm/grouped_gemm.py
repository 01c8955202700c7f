"""The batch-invariant grouped GEMM (``truefuse/kernels/grouped_gemm.py``): launchers as custom ops,
the per-group reference, and the device offsets of ``m_splits``.

Rows ordered by group, ``offsets`` (int64, G + 1 entries on the operands' device, the cumulative
sum of the group sizes; :func:`split_offsets` makes it from a list or a tensor without a host sync):

* :func:`grouped_mm_rows`: ``y[rows of g] = x[rows of g] @ w_gᵀ (+ bias_g)`` (``transpose_w=True``,
  the forward with a packed (G, N, K) weight) or ``x[rows of g] @ w_g`` (``transpose_w=False``, the
  input gradient).
* :func:`grouped_mm_wgrad`: ``dW_g = dy[rows of g]ᵀ @ x[rows of g]`` (G, N, K), written (weight
  dtype or fp32) or accumulated (beta=1) into an fp32 ``main_grad``.
* :func:`grouped_bias_grad`: ``Σ_{rows of g} dy`` (G, N) in fp32, rounded once.

Contract (docs/design.md §1, "Grouped GEMM"): each group's output rows (and dW_g, db_g) are bitwise
independent of the other groups' sizes, their order and the batch they arrive in (one tile
configuration per dtype and problem kind, ``ops/grouped_gemm/grouped_gemm_config.py``), and bounded against one
``F.linear`` / matmul per group (:func:`grouped_gemm_ref`, :func:`grouped_gemm_wgrad_ref`).

A device tensor of sizes cannot be checked on the host without a sync: :func:`split_offsets` checks
it with ``torch._assert_async`` (non-negative, summing to the rows: a device-side assert on CUDA),
and the kernels clamp the offsets to ``[0, M]``, so wrong sizes never read or write out of bounds.
"""

from __future__ import annotations

import itertools

import torch

from truefuse.config import get_config
from truefuse.ops._launch.custom_op import custom_op, launch
from truefuse.ops._launch.triton import sm_count
from truefuse.ops.gemm.gemm_checks import check_splits
from truefuse.ops.grouped_gemm.grouped_gemm_config import HALF, INTERPRETER_PROGRAMS, TileConfig, tile_config

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _programs(device: torch.device, cfg: TileConfig, tiles: int) -> int:
    if device.type != "cuda":
        n = INTERPRETER_PROGRAMS
    elif cfg.programs_per_sm == 0:
        n = tiles
    else:
        n = sm_count(device.index if device.index is not None else torch.cuda.current_device()) * cfg.programs_per_sm
    return max(1, min(n, tiles))


def grouped_gemm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernels run here: CUDA for fp16/bf16/fp32, the CPU under ``TRITON_INTERPRET=1``
    for fp32 only (the interpreter truncates bf16 casts, docs/design.md §8)."""
    if device.type == "cuda":
        return dtype in _DTYPES
    return device.type == "cpu" and get_config().triton_interpret and dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# m_splits -> device offsets


def check_split_tensor(m_splits: torch.Tensor, groups: int) -> None:
    """Host checks of a tensor of group sizes that need no sync: 1-D, integer, ``groups`` entries."""
    if m_splits.dim() != 1 or m_splits.dtype.is_floating_point or m_splits.dtype.is_complex or m_splits.dtype == torch.bool:
        raise TypeError(f"m_splits must be a 1-D integer tensor, got {m_splits.dtype} of shape {tuple(m_splits.shape)}")
    if m_splits.shape[0] != groups:
        raise ValueError(f"m_splits has {m_splits.shape[0]} groups but there are {groups}")


def split_offsets(m_splits, groups: int, total: int, device: torch.device, *, check: bool = True) -> torch.Tensor:
    """``m_splits`` as the kernels' offsets: int64 (groups + 1,) on ``device``, ``[0, cumsum...]``.

    ``m_splits``: a list of integral scalars or a 1-D NumPy integer array (checked on the host, like
    ``truefuse.gemm``'s, then copied to the device asynchronously from pinned memory), or a 1-D
    integer tensor on any device (cumsum on its device, no host sync). A tensor on ``device``'s CUDA
    device cannot be checked without a sync: with ``check`` its sizes are asserted non-negative and
    summing to ``total`` by ``torch._assert_async`` (a device-side assert; on the CPU a RuntimeError).
    ``check=False`` with a list: the caller has checked it (``check_splits``; the layers do, once).
    """
    device = torch.device(device)
    if isinstance(m_splits, torch.Tensor):
        check_split_tensor(m_splits, groups)
        s = m_splits.to(torch.int64)
        if s.device.type == "cpu" and not torch.compiler.is_compiling():  # host data: checked here, no sync
            if bool((s < 0).any()):
                raise ValueError(f"m_splits has a negative group size: {[int(v) for v in s]}")
            if int(s.sum()) != total:
                raise ValueError(f"m_splits sums to {int(s.sum())} but the number of rows of x is {total}")
            check = False
        if s.device != device:
            if s.device.type == "cpu" and device.type == "cuda" and not torch.compiler.is_compiling():
                s = s.pin_memory()
            s = s.to(device, non_blocking=True)
        offsets = torch.cat([s.new_zeros(1), torch.cumsum(s, 0)])
        if check:
            ok = (offsets[-1] == total) & (s.min() >= 0) if groups else offsets[-1] == total
            torch._assert_async(ok, "m_splits: group sizes must be non-negative and sum to the number of rows of x")
        return offsets
    splits = check_splits(m_splits, groups, total, "the number of rows of x") if check else m_splits
    host = torch.tensor([0, *itertools.accumulate(splits)], dtype=torch.int64)
    if device.type == "cuda" and not torch.compiler.is_compiling():
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


# ---------------------------------------------------------------------------------------------
# Checks (before any launch, naming the argument)


def _check_operand(name: str, t, like: torch.Tensor | None = None, dim: int | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if like is None:
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; the grouped GEMM takes float16, bfloat16 or float32")
        if not grouped_gemm_available(t.device, t.dtype):
            raise ValueError(
                f"{name}: the grouped GEMM runs on CUDA (fp16/bf16/fp32) or, under TRITON_INTERPRET=1, on the CPU "
                f"for float32; got {t.dtype} on {t.device}"
            )
        return
    if t.device != like.device:
        raise ValueError(f"{name} is on {t.device} but x is on {like.device}")


def _check_offsets(offsets, like: torch.Tensor, groups: int | None) -> int:
    _check_operand("offsets", offsets, like, dim=1)
    if offsets.dtype != torch.int64:
        raise TypeError(f"offsets must be int64 (split_offsets makes them), got {offsets.dtype}")
    if offsets.shape[0] < 2:
        raise ValueError(f"offsets needs at least 2 entries (one group), got {offsets.shape[0]}")
    if groups is not None and offsets.shape[0] != groups + 1:
        raise ValueError(f"offsets has {offsets.shape[0]} entries but there are {groups} groups (need groups + 1)")
    return offsets.shape[0] - 1


def _check_out(out, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...], like: torch.Tensor) -> None:
    _check_operand("out", out, like)
    if tuple(out.shape) != shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {shape}")
    if out.dtype not in dtypes:
        raise TypeError(f"out has dtype {out.dtype}, expected {' or '.join(dict.fromkeys(map(str, dtypes)))}")


def _check_not_aliased(out: torch.Tensor, *inputs) -> None:
    """In the op (eager or compiled), where storages have addresses."""
    for t in inputs:
        if t is not None and t.numel() and out.numel() and t.untyped_storage().data_ptr() == out.untyped_storage().data_ptr():
            raise ValueError("out shares memory with an input; the grouped GEMM cannot write over its operands")


# ---------------------------------------------------------------------------------------------
# Public launchers


def grouped_mm_rows(
    x: torch.Tensor,
    w: torch.Tensor,
    offsets: torch.Tensor,
    *,
    transpose_w: bool,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y[rows of g] = x[rows of g] @ w_gᵀ + bias_g`` (``transpose_w``: ``w`` (G, N, K)) or
    ``x[rows of g] @ w_g`` (``w`` (G, K, N)), one batch-invariant launch.

    Args:
        x: (M, K) fp16/bf16/fp32, rows ordered by group, any strides.
        w: packed weights, (G, N, K) with ``transpose_w`` else (G, K, N), ``x``'s dtype, any strides.
        offsets: int64 (G + 1,) on ``x``'s device (:func:`split_offsets`).
        bias: optional (G, N) in ``x``'s dtype, added in fp32 before the one rounding.
        out: optional (M, N) of ``x``'s dtype or fp32 to write into (else a new tensor).
    """
    _check_operand("x", x, dim=2)
    _check_operand("w", w, x, dim=3)
    if w.dtype != x.dtype:
        raise TypeError(f"w ({w.dtype}) and x ({x.dtype}) must have the same dtype")
    G = w.shape[0]
    _check_offsets(offsets, x, G)
    K = w.shape[2] if transpose_w else w.shape[1]
    N = w.shape[1] if transpose_w else w.shape[2]
    if x.shape[1] != K:
        raise ValueError(
            f"x has {x.shape[1]} columns but w {'(G, N, K)' if transpose_w else '(G, K, N)'} of shape {tuple(w.shape)} needs {K}"
        )
    if bias is not None:
        _check_operand("bias", bias, x, dim=2)
        if tuple(bias.shape) != (G, N):
            raise ValueError(f"bias has shape {tuple(bias.shape)}, expected {(G, N)}")
        if bias.dtype != x.dtype:
            raise TypeError(f"bias has dtype {bias.dtype}, expected {x.dtype}")
    if out is None:
        out = torch.empty((x.shape[0], N), dtype=x.dtype, device=x.device)
    else:
        _check_out(out, (x.shape[0], N), (x.dtype, torch.float32), x)
    launch(grouped_gemm_rows_op, x, w, offsets, bias, bool(transpose_w), out)
    return out


def grouped_mm_wgrad(
    dy: torch.Tensor,
    x: torch.Tensor,
    offsets: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``dW_g = dy[rows of g]ᵀ @ x[rows of g]`` for every group: (G, N, K), one batch-invariant launch.

    Args:
        dy: (M, N), x: (M, K) of one dtype (fp16/bf16/fp32), rows ordered by group, any strides.
        offsets: int64 (G + 1,) on their device (:func:`split_offsets`).
        out: optional contiguous (G, N, K) of ``dy``'s dtype or fp32; ``accumulate=True`` adds into it
            (beta=1, e.g. an fp32 ``main_grad``; an empty group leaves its slice untouched). Without
            ``accumulate`` an empty group's slice is zero.
        out_dtype: the new output's dtype without ``out`` (``dy``'s or fp32).
    """
    _check_operand("dy", dy, dim=2)
    _check_operand("x", x, dy, dim=2)
    if x.dtype != dy.dtype:
        raise TypeError(f"dy ({dy.dtype}) and x ({x.dtype}) must have the same dtype")
    if x.shape[0] != dy.shape[0]:
        raise ValueError(f"dy has {dy.shape[0]} rows but x has {x.shape[0]}")
    G = _check_offsets(offsets, dy, None)
    shape = (G, dy.shape[1], x.shape[1])
    if accumulate and out is None:
        raise ValueError("accumulate=True adds into an existing output: pass out=")
    if out_dtype is not None and out_dtype not in (dy.dtype, torch.float32):
        raise TypeError(f"out_dtype={out_dtype} is not supported for {dy.dtype} inputs; use {dy.dtype} or torch.float32")
    if out is None:
        out = torch.empty(shape, dtype=out_dtype or dy.dtype, device=dy.device)
    else:
        _check_out(out, shape, (dy.dtype, torch.float32), dy)
        if out_dtype is not None and out.dtype != out_dtype:
            raise TypeError(f"out has dtype {out.dtype} but out_dtype is {out_dtype}")
    launch(grouped_gemm_wgrad_op, dy, x, offsets, out, bool(accumulate))
    return out


def grouped_bias_grad(dy: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Per group ``Σ_{rows of g} dy`` (G, N): an fp32 segment sum in fixed row steps from each
    group's first row, rounded once to ``dtype`` (default ``dy``'s); an empty group gives zeros."""
    _check_operand("dy", dy, dim=2)
    _check_offsets(offsets, dy, None)
    s = launch(grouped_gemm_bgrad_op, dy, offsets)
    return s.to(dtype or dy.dtype)


# ---------------------------------------------------------------------------------------------
# References: one GEMM per group (host splits)


def grouped_gemm_ref(
    x: torch.Tensor, w: torch.Tensor, m_splits, *, transpose_w: bool = True, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """One ``F.linear`` (``transpose_w``) or matmul per group, in ``x``'s dtype (fp32 accumulation
    inside the BLAS); the bounded baseline, and on float64 inputs the reference."""
    splits = check_splits(m_splits, w.shape[0], x.shape[0], "the number of rows of x")
    N = w.shape[1] if transpose_w else w.shape[2]
    outs, start = [x.new_empty((0, N))], 0
    for g, m in enumerate(splits):
        xg = x[start : start + m]
        b = None if bias is None else bias[g]
        if transpose_w:
            outs.append(torch.nn.functional.linear(xg, w[g], b))
        else:
            outs.append(xg @ w[g] if b is None else xg @ w[g] + b)
        start += m
    return torch.cat(outs)


def grouped_gemm_wgrad_ref(dy: torch.Tensor, x: torch.Tensor, m_splits) -> torch.Tensor:
    """``dy[rows of g]ᵀ @ x[rows of g]`` per group, stacked (G, N, K), in ``dy``'s dtype."""
    splits = check_splits(m_splits, None, x.shape[0], "the number of rows of x")
    outs, start = [], 0
    for m in splits:
        outs.append(dy[start : start + m].t() @ x[start : start + m])
        start += m
    return torch.stack(outs)


# ---------------------------------------------------------------------------------------------
# Launches (one configuration in, no choice from the sizes)

#: Groups whose offsets the Hopper rows kernel reads at once (one vector load per chunk, not one
#: dependent load per group); only the walk over the tiles, never the bits.
_GCHUNK = 64


def _tma_rows_ok(t: torch.Tensor) -> bool:
    """A (.., rows, cols) operand a TMA descriptor takes as is: last dim contiguous, 16-byte
    aligned base and row strides."""
    es = t.element_size()
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all((st * es) % 16 == 0 for st in t.stride()[:-1])


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or a contiguous (freshly allocated, so aligned) copy: same values, same bits."""
    return t if _tma_rows_ok(t) else t.clone(memory_format=torch.contiguous_format)


def _use_tma(cfg: TileConfig, dtype: torch.dtype, *inner: int) -> bool:
    """The TMA kernels: asked for by ``cfg``, fp16/bf16, and every operand's row (the weight's two
    inner dims) a multiple of 16 bytes: a property of the layer's shape, never of the batch."""
    es = dtype.itemsize
    return cfg.tma and dtype in HALF and all(d > 0 and (d * es) % 16 == 0 for d in inner)


def _launch_rows(x, w, offsets, bias, transpose_w: bool, out, cfg: TileConfig) -> None:
    from truefuse.kernels.grouped_gemm import _grouped_gemm_rows_kernel, _grouped_gemm_rows_tma_kernel

    b = w.transpose(1, 2) if transpose_w else w  # (G, K, N) view
    G, K, N = b.shape
    M = x.shape[0]
    num_n = -(-N // cfg.block_n)
    bound = (-(-M // cfg.block_m) + G) * num_n  # Σ_g ceil(m_g / BLOCK_M) ≤ ceil(M / BLOCK_M) + G
    grid = (_programs(x.device, cfg, bound),)
    if _use_tma(cfg, x.dtype, w.shape[1], w.shape[2]):
        from triton.tools.tensor_descriptor import TensorDescriptor

        x, w = _tma_ready(x), _tma_ready(w)
        a_desc = TensorDescriptor(x, [M, K], [x.stride(0), 1], [cfg.block_m, cfg.block_k])
        inner = [cfg.block_n, cfg.block_k] if transpose_w else [cfg.block_k, cfg.block_n]
        b_desc = TensorDescriptor(w, list(w.shape), list(w.stride()), [1, *inner])
        _grouped_gemm_rows_tma_kernel[grid](
            a_desc,
            b_desc,
            out,
            bias if bias is not None else out,
            offsets,
            G,
            M,
            N,
            K,
            out.stride(0),
            out.stride(1),
            bias.stride(0) if bias is not None else 0,
            HAS_BIAS=bias is not None,
            B_NK=bool(transpose_w),
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            GROUP_M=8,
            GCHUNK=_GCHUNK,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
        return
    _grouped_gemm_rows_kernel[grid](
        x,
        b,
        out,
        bias if bias is not None else out,
        offsets,
        G,
        M,
        N,
        K,
        x.stride(0),
        x.stride(1),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        out.stride(0),
        out.stride(1),
        bias.stride(0) if bias is not None else 0,
        HAS_BIAS=bias is not None,
        IEEE=x.dtype == torch.float32,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=8,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def _launch_wgrad(dy, x, offsets, out, accumulate: bool, cfg: TileConfig):
    """One weight-gradient launch under ``cfg``; returns the compiled kernel (its registers and
    shared memory, for the experiments)."""
    from truefuse.kernels.grouped_gemm import _grouped_gemm_wgrad_kernel, _grouped_gemm_wgrad_tma_kernel

    G, N, K = out.shape
    M = dy.shape[0]
    tiles = G * -(-N // cfg.block_n) * -(-K // cfg.block_k)
    grid = (_programs(dy.device, cfg, tiles),)
    if _use_tma(cfg, dy.dtype, N, K):
        from triton.tools.tensor_descriptor import TensorDescriptor

        dy, x = _tma_ready(dy), _tma_ready(x)
        dy_desc = TensorDescriptor(dy, [M, N], [dy.stride(0), 1], [cfg.block_m, cfg.block_n])
        x_desc = TensorDescriptor(x, [M, K], [x.stride(0), 1], [cfg.block_m, cfg.block_k])
        # out is written in place, never copied: its descriptor only where its rows allow one
        c_desc = None
        if cfg.tma_epilogue and _tma_rows_ok(out):
            c_desc = TensorDescriptor(out, [G, N, K], list(out.stride()), [1, cfg.block_n, cfg.block_k // cfg.epilogue_split])
        return _grouped_gemm_wgrad_tma_kernel[grid](
            dy_desc,
            x_desc,
            c_desc,
            out,
            offsets,
            G,
            M,
            N,
            K,
            out.stride(0),
            out.stride(1),
            out.stride(2),
            ACCUMULATE=bool(accumulate),
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            BLOCK_M=cfg.block_m,
            TMA_EPI=c_desc is not None,
            EPI_SPLIT=cfg.epilogue_split,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    return _grouped_gemm_wgrad_kernel[grid](
        dy,
        x,
        out,
        offsets,
        G,
        M,
        N,
        K,
        dy.stride(0),
        dy.stride(1),
        x.stride(0),
        x.stride(1),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        ACCUMULATE=bool(accumulate),
        IEEE=dy.dtype == torch.float32,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        BLOCK_M=cfg.block_m,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


# ---------------------------------------------------------------------------------------------
# Custom ops (docs/design.md §6.7): one opaque call per launch under torch.compile.


@custom_op("truefuse::grouped_gemm_rows", mutates_args=("out",))
def grouped_gemm_rows_op(
    x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, bias: torch.Tensor | None, transpose_w: bool, out: torch.Tensor
) -> None:
    """:func:`grouped_mm_rows`, validated, writing ``out``."""
    _check_not_aliased(out, x, w, bias, offsets)
    b = w.transpose(1, 2) if transpose_w else w  # (G, K, N) view
    G, K, N = b.shape
    M = x.shape[0]
    if M == 0 or N == 0:
        return
    if K == 0:
        # no product: the bias alone (or zeros), per row's group
        out.zero_()
        if bias is not None:
            sizes = offsets.diff().clamp_min(0)
            out.copy_(torch.repeat_interleave(bias, sizes, dim=0, output_size=M))
        return
    _launch_rows(x, w, offsets, bias, transpose_w, out, tile_config("rows", x.dtype, x.device, N * K))


@grouped_gemm_rows_op.register_fake
def _(x, w, offsets, bias, transpose_w, out):
    return None


@custom_op("truefuse::grouped_gemm_wgrad", mutates_args=("out",))
def grouped_gemm_wgrad_op(dy: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
    """:func:`grouped_mm_wgrad`, validated, writing (or adding into) ``out``."""
    _check_not_aliased(out, dy, x, offsets)
    G, N, K = out.shape
    M = dy.shape[0]
    if G == 0 or N == 0 or K == 0:
        return
    if M == 0:
        if not accumulate:
            out.zero_()
        return
    _launch_wgrad(dy, x, offsets, out, accumulate, tile_config("wgrad", dy.dtype, dy.device, N * K, bool(accumulate)))


@grouped_gemm_wgrad_op.register_fake
def _(dy, x, offsets, out, accumulate):
    return None


@custom_op("truefuse::grouped_gemm_bgrad", mutates_args=())
def grouped_gemm_bgrad_op(dy: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The per-group fp32 sums of ``dy``'s rows, (G, N)."""
    from truefuse.kernels.grouped_gemm import _grouped_gemm_bgrad_kernel

    G, (M, N) = offsets.shape[0] - 1, dy.shape
    out = torch.zeros((G, N), dtype=torch.float32, device=dy.device)
    if M == 0 or N == 0 or G == 0:
        return out
    cfg = tile_config("bgrad", dy.dtype, dy.device)
    _grouped_gemm_bgrad_kernel[(G, -(-N // cfg.block_n))](
        dy,
        out,
        offsets,
        M,
        N,
        dy.stride(0),
        dy.stride(1),
        out.stride(0),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        num_warps=cfg.num_warps,
    )
    return out


@grouped_gemm_bgrad_op.register_fake
def _(dy, offsets):
    return dy.new_empty((offsets.shape[0] - 1, dy.shape[1]), dtype=torch.float32)
