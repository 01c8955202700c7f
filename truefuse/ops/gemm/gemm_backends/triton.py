"""The ``triton`` GEMM backend: truefuse's Triton GEMM (``truefuse/kernels/gemm.py``).

fp32 accumulators, the activation-derivative prologue and the bias-gradient epilogue of a
weight-gradient GEMM, writing or accumulating into a wider output. On the CPU it exists only under
``TRITON_INTERPRET=1``, and only for fp32: the interpreter's bf16/fp16 casts truncate and its bf16
``tl.dot`` is wrong (docs/design.md §8), so half-precision rows are CUDA-only.
"""

from __future__ import annotations

import torch

from truefuse.config import get_config
from truefuse.ops._launch.fast_launch import fast_launch
from truefuse.ops._launch.prepared import prepare
from truefuse.ops._launch.triton import hopper, sm_count
from truefuse.ops.gemm.gemm_backends._base import BF16, F16, F32, WIDEN, GemmArgs, GemmBackend, rows
from truefuse.ops.gemm.gemm_bi_config import BLOCK_K as BI_BLOCK_K
from truefuse.ops.gemm.gemm_bi_config import GROUP_M, M_BUCKETS, TMA_TILE, WIDE_N, bucket, group, layout

_FEATURES = ["mm", "accumulate", "grad_activation", "grad_bias"]
# ``batch_invariant``: BLOCK_K fixed per dtype, no split-K, and in that mode a launch table
# (``bi_config``, ``truefuse/ops/gemm/gemm_bi_config.py``) whose tiles, chosen from M, all give a row the
# same bits (checked on the GPU), so a row's bits never depend on M (docs/design.md §1). Not on the CPU:
# the interpreter's tl.dot is NumPy's matmul of the tiles, whose rows change bits with their place
# in the tile (a row moved within a 32x16 @ 16x32 product differed), so there rows invariant to M
# need the row-block split path
CAPABILITIES = frozenset(
    rows([*_FEATURES, "batch_invariant"], [(F16, F16), (BF16, BF16), (F32, F32)], ["cuda"])
    | rows([*_FEATURES, "out_dtype", "batch_invariant"], WIDEN, ["cuda"])
    | rows(_FEATURES, [(F32, F32)], ["cpu"])
)


def available(device: str) -> bool:
    if device == "cuda":
        return torch.cuda.is_available()
    return device == "cpu" and get_config().triton_interpret


def _configs(dtype: torch.dtype):
    import triton

    block_k = 32 if dtype == torch.float32 else 64  # fixed per dtype: batch invariance
    if get_config().triton_interpret:
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 4})]
    shapes = [(128, 256, 8, 3), (256, 128, 8, 3), (128, 128, 8, 4), (128, 128, 4, 4), (64, 128, 4, 4)]
    if dtype == torch.float32:
        shapes = [(64, 64, 4, 3), (128, 64, 4, 3), (64, 128, 4, 3)]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": block_k, "GROUP_M": 8}, num_warps=w, num_stages=s)
        for bm, bn, w, s in shapes
    ]


_TUNED: dict = {}
_BI: dict = {}


def bi_config(dtype: torch.dtype, M: int, form: str = "nt", N: int = 0):
    """Batch-invariant mode's tile configuration for ``M`` rows of an ``N``-column output
    (``truefuse/ops/gemm/gemm_bi_config.py``).

    BLOCK_K is fixed per dtype in every entry and the K loop is one sequence, so the table's tile,
    chosen from M, N and B's layout ``form``, only decides which program computes a row, never its
    reduction order; every entry is checked bitwise against the others on the GPU (docs/design.md
    §1). Under the interpreter: the one CPU configuration, whatever M."""
    import triton

    import truefuse.ops.gemm.gemm_bi_config as bc

    if get_config().triton_interpret:
        return _configs(dtype)[0]
    tiles = bc.bi_tiles(dtype, M, form, N)
    key = (bc.group(dtype), tiles)
    if key not in _BI:
        block_m, block_n, warps, stages = tiles
        meta = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": bc.BLOCK_K[key[0]], "GROUP_M": bc.GROUP_M}
        _BI[key] = triton.Config(meta, num_warps=warps, num_stages=stages)
    return _BI[key]


#: launch keywords of the batch-invariant GEMM, by (dtype, M bucket, layout, interpreter): the table
#: lookup and the keyword dict cost ~10 µs a call, which a decode-sized GEMM pays in full
#: (docs/benchmarks.md, "Batch-invariant mode")
_BI_META: dict = {}


def _bi_meta(dtype: torch.dtype, M: int, form: str, N: int = 0) -> dict:
    wide = N >= WIDE_N
    key = (dtype, bucket(M), form, wide, get_config().triton_interpret)
    meta = _BI_META.get(key)
    if meta is None:
        cfg = bi_config(dtype, M, form, N)  # its tile depends on N only through ``wide``
        meta = _BI_META[key] = {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    return meta


def _kernel(dtype: torch.dtype):
    """The Triton GEMM, autotuned over tile shapes only (BLOCK_K fixed per dtype)."""
    if dtype not in _TUNED:
        import triton

        from truefuse.kernels.gemm import _gemm_kernel

        _TUNED[dtype] = triton.autotune(
            configs=_configs(dtype),
            key=["M", "N", "K", "ACCUMULATE", "GRAD_ACT", "GRAD_BIAS"],
            # tuning runs the kernel several times: an accumulated output must be restored
            restore_value=["c_ptr"],
        )(_gemm_kernel)
    return _TUNED[dtype]


def product(args: GemmArgs, a: torch.Tensor, b: torch.Tensor, fused: tuple[str, ...], target: torch.Tensor, beta1: bool) -> None:
    import triton

    from truefuse.kernels.activation import ACT_CODES

    M = a.shape[0]
    N = b.shape[1]
    grad_act = args.grad_activation if "grad_activation" in fused else None
    pre = args.pre_activation if grad_act else a
    gb = args.grad_bias_out if "grad_bias" in fused else None
    if M == 0 or N == 0:
        if gb is not None:
            gb.zero_()
        return
    gb_target = gb
    if gb is not None and gb.dtype != torch.float32 and get_config().triton_interpret:
        # the interpreter's narrowing casts truncate (docs/design.md §8): round on the host instead
        gb_target = torch.empty(gb.shape, dtype=torch.float32, device=gb.device)
    if "batch_invariant" in fused:
        from truefuse.kernels.gemm import _gemm_kernel

        if grad_act is None and gb is None:
            bi_launch(a, b, target, beta1)  # a bare product, or accumulated: the plain call's launch (TMA where it fits)
            return
        meta = _bi_meta(a.dtype, M, layout(b), N)
        kernel, grid = _gemm_kernel, _bi_grid(M, N, meta)
    else:
        kernel, meta = _kernel(a.dtype), {}
        grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
    out2 = gb_target if gb is not None else target
    _launch(kernel, grid, a, b, target, pre, out2, beta1, ACT_CODES[grad_act], gb is not None, meta)
    if gb_target is not gb:
        gb.copy_(gb_target)


def bi_launch(a: torch.Tensor, b: torch.Tensor, target: torch.Tensor, accumulate: bool = False) -> None:
    """:func:`product`'s batch-invariant launch for a bare product (no derivative prologue, no
    bias-gradient; M and N not 0), into ``target`` or added to it (``accumulate``: the fp32 sum
    rounded once, in either kernel's epilogue): the plain call's runner
    (``ops/gemm/gemm_runners.py::_runner``) launches it without the plan's executor around it."""
    from truefuse.kernels.activation import ACT_CODES
    from truefuse.kernels.gemm import _gemm_kernel

    M, N = a.shape[0], b.shape[1]
    form = layout(b)
    if _tma_fits(a, b, target, form):
        _bi_tma_launch(a, b, target, form, accumulate)
        return
    meta = _bi_meta(a.dtype, M, form, N)
    _launch(_gemm_kernel, _bi_grid(M, N, meta), a, b, target, a, target, accumulate, ACT_CODES[None], False, meta)


def bi_prepared(a: torch.Tensor, b: torch.Tensor, target: torch.Tensor):
    """The launch :func:`bi_launch` just made for these operands, kept whole
    (``ops/_launch/prepared.py``): ``go(stream, a, b, target)`` (addresses), or None (the TMA
    kernel, whose launch needs Triton's scratch allocator; no handle kept yet)."""
    from truefuse.kernels.activation import ACT_CODES
    from truefuse.kernels.gemm import _gemm_kernel

    M, N = a.shape[0], b.shape[1]
    form = layout(b)
    if _tma_fits(a, b, target, form):
        return None
    meta = _bi_meta(a.dtype, M, form, N)
    grid = _bi_grid(M, N, meta)
    args, kwargs = _launch_args(a, b, target, a, target, False, ACT_CODES[None], False, meta)
    return prepare((a, b, target), _gemm_kernel, grid, *args, **kwargs)


def _tma_fits(a: torch.Tensor, b: torch.Tensor, target: torch.Tensor, form: str) -> bool:
    """Whether the persistent TMA kernel takes this bare batch-invariant product: Hopper, bf16/fp16,
    the last M bucket, rows of ``a``, ``b``'s weight and ``target`` contiguous in their last
    dimension with 16-byte aligned bases and row strides (TMA's rules). Its bits are the table
    tile's (gemm_bi_config.TMA_TILE), so the choice never changes a result."""
    if a.dtype not in (BF16, F16) or target.dtype is not a.dtype or bucket(a.shape[0]) != len(M_BUCKETS) - 1:
        return False
    if not hopper(a) or get_config().triton_interpret:
        return False
    w = b.t() if form == "nt" else b  # the weight as stored: (N, K) for x Wᵀ, (K, N) for dy W
    for t in (a, w):
        if t.stride(1) != 1 or t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16:
            return False
    return target.stride(1) == 1


def _bi_tma_launch(a: torch.Tensor, b: torch.Tensor, target: torch.Tensor, form: str, accumulate: bool = False) -> None:
    from truefuse.kernels.gemm_tma import _gemm_tma_kernel

    (M, K), N = a.shape, b.shape[1]
    bm, bn, warps, stages = TMA_TILE[form]
    w = b.t() if form == "nt" else b  # the weight as stored: its rows contiguous (_tma_fits)
    tiles = -(-M // bm) * -(-N // bn)
    with _tma_scratch(a.device):
        fast_launch(
            _gemm_tma_kernel,
            (min(tiles, sm_count(a.device.index or 0)),),
            a,
            w,
            target,
            M,
            N,
            K,
            a.stride(0),
            w.stride(0),
            target.stride(0),
            B_NK=form == "nt",
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_K=BI_BLOCK_K[group(a.dtype)],
            GROUP_M=GROUP_M,
            ACCUMULATE=accumulate,
            num_warps=warps,
            num_stages=stages,
        )


class _tma_scratch:
    """Triton's global-scratch allocator for the launch (the device-made descriptors' 128 bytes
    each), then whatever was set before: truefuse leaves Triton's process-wide setting alone."""

    __slots__ = ("device", "token")

    def __init__(self, device) -> None:
        self.device = device

    def _alloc(self, size: int, alignment: int, stream) -> torch.Tensor:
        return torch.empty(size, dtype=torch.int8, device=self.device)

    def __enter__(self) -> None:
        from triton.runtime import _allocation

        self.token = _allocation._allocator.set(self._alloc)

    def __exit__(self, *exc) -> None:
        from triton.runtime import _allocation

        _allocation._allocator.reset(self.token)


def bi_launch_segments(a: torch.Tensor, bs: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
    """:func:`bi_launch` of one (M, K) ``a`` against up to three (K, N_s) ``bs`` of one layout, into
    contiguous (M, N_s) ``outs``, in one launch: each ``outs[s]`` gets the bits of
    ``bi_launch(a, bs[s], outs[s])`` (the same tile from the same table entry, which depends on M and
    the layout only: no ``WIDE`` tile for the forward's layout, the siblings';
    ``kernels/gemm.py::_gemm_segments_kernel``). M and every N_s not 0."""
    kernel, grid, args, kwargs = _segments_launch(a, bs, outs)
    fast_launch(kernel, grid, *args, **kwargs)


def bi_segments_prepared(a: torch.Tensor, bs: list[torch.Tensor], outs: list[torch.Tensor]):
    """The launch :func:`bi_launch_segments` just made for these operands, kept whole
    (``ops/_launch/prepared.py``): ``go(stream, a, *bs, *outs)`` (addresses), or None."""
    kernel, grid, args, kwargs = _segments_launch(a, bs, outs)
    return prepare((a, *bs, *outs), kernel, grid, *args, **kwargs)


def _segments_launch(a: torch.Tensor, bs: list[torch.Tensor], outs: list[torch.Tensor]) -> tuple:
    """The segmented GEMM's kernel, grid, arguments and keywords for :func:`bi_launch_segments`."""
    from truefuse.kernels.gemm import _gemm_segments_kernel

    M, K = a.shape
    meta = {k: v for k, v in _bi_meta(a.dtype, M, layout(bs[0])).items() if k != "GROUP_M"}
    ns = [b.shape[1] for b in bs] + [0] * (3 - len(bs))  # an unused segment: N = 0, no tiles
    bs, outs = list(bs) + [bs[0]] * (3 - len(bs)), list(outs) + [outs[0]] * (3 - len(outs))
    tiles = sum(-(-n // meta["BLOCK_N"]) for n in ns)
    args = (a, bs[0], outs[0], bs[1], outs[1], bs[2], outs[2], M, *ns, K, *a.stride(), *bs[0].stride())
    kwargs = dict(IEEE=a.dtype == torch.float32, **meta)
    return _gemm_segments_kernel, (-(-M // meta["BLOCK_M"]) * tiles,), args, kwargs


def _bi_grid(M: int, N: int, meta: dict) -> tuple[int]:
    return (-(-M // meta["BLOCK_M"]) * -(-N // meta["BLOCK_N"]),)


def _launch(kernel, grid, a, b, target, pre, out2, accumulate: bool, grad_act: int, grad_bias: bool, meta: dict) -> None:
    """The GEMM kernel on (M, K) ``a`` and (K, N) ``b`` into ``target``; ``pre`` the derivative
    prologue's pre-activation (``a`` where none), ``out2`` the bias gradient's output (``target``
    where none)."""
    args, kwargs = _launch_args(a, b, target, pre, out2, accumulate, grad_act, grad_bias, meta)
    fast_launch(kernel, grid, *args, **kwargs)


def _launch_args(a, b, target, pre, out2, accumulate: bool, grad_act: int, grad_bias: bool, meta: dict) -> tuple[tuple, dict]:
    """The GEMM kernel's arguments and keywords for :func:`_launch` (and :func:`bi_prepared`)."""
    M, K = a.shape
    args = (a, b, target, pre, out2, M, b.shape[1], K, *a.stride(), *b.stride(), *target.stride(), *pre.stride())
    kwargs = dict(ACCUMULATE=accumulate, GRAD_ACT=grad_act, GRAD_BIAS=grad_bias, IEEE=a.dtype == torch.float32, **meta)
    return args, kwargs


BACKEND = GemmBackend(name="triton", capabilities=CAPABILITIES, available=available, product=product)


def run_tiles(a: torch.Tensor, b: torch.Tensor, tiles: tuple[int, int, int, int]) -> torch.Tensor:
    """``a @ b`` by the Triton GEMM with ``tiles`` (BLOCK_M, BLOCK_N, warps, stages) and the dtype's
    fixed BLOCK_K: the GPU check that every entry of batch-invariant mode's table gives the same
    bits (tests, ``bench_bi_gemm``, ``experiments/exp_bi_gemm_tiles.py``)."""
    import triton

    import truefuse.ops.gemm.gemm_bi_config as bc
    from truefuse.kernels.gemm import _gemm_kernel

    (M, K), N = a.shape, b.shape[1]
    out = torch.empty(M, N, device=a.device, dtype=a.dtype)
    bm, bn, warps, stages = tiles
    _gemm_kernel[(triton.cdiv(M, bm) * triton.cdiv(N, bn),)](
        a,
        b,
        out,
        a,
        out,
        M,
        N,
        K,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        out.stride(1),
        a.stride(0),
        a.stride(1),
        ACCUMULATE=False,
        GRAD_ACT=0,
        GRAD_BIAS=False,
        IEEE=a.dtype == torch.float32,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bc.BLOCK_K[bc.group(a.dtype)],
        GROUP_M=bc.GROUP_M,
        num_warps=warps,
        num_stages=stages,
    )
    return out
