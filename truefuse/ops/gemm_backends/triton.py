"""The ``triton`` GEMM backend: truefuse's Triton GEMM (``truefuse/kernels/gemm.py``).

fp32 accumulators, the activation-derivative prologue and the bias-gradient epilogue of a
weight-gradient GEMM, writing or accumulating into a wider output. On the CPU it exists only under
``TRITON_INTERPRET=1``, and only for fp32: the interpreter's bf16/fp16 casts truncate and its bf16
``tl.dot`` is wrong (docs/design.md §8), so half-precision rows are CUDA-only.
"""

from __future__ import annotations

import torch

from truefuse.config import get_config
from truefuse.ops.gemm_backends._base import BF16, F16, F32, WIDEN, GemmArgs, GemmBackend, rows

_FEATURES = ["mm", "accumulate", "grad_activation", "grad_bias"]
# ``batch_invariant``: BLOCK_K fixed per dtype, no split-K, and in that mode one tile configuration
# per dtype (``bi_config``), so a row's bits never depend on M (docs/design.md §1). Not on the CPU:
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
_FIXED: dict = {}

#: batch-invariant mode's tiles (BLOCK_M, BLOCK_N, warps, stages) per dtype (fp16 takes bf16's)
BI_TILES = {torch.bfloat16: (128, 128, 8, 4), torch.float32: (64, 64, 4, 3)}


def bi_config(dtype: torch.dtype):
    """The one tile configuration of batch-invariant mode for ``dtype`` (never chosen from M).

    Autotuning keyed on M could give a decode call (M = 1) other tiles, warps or MMA instructions
    (wgmma needs 64-row tiles) than a prefill call, and nothing guarantees those give a row the same
    bits; one configuration does. 128×128 tiles, 8 warps, 4 stages: a config of the autotuned set
    above (docs/benchmarks.md, "Batch-invariant GEMM")."""
    import triton

    if get_config().triton_interpret:
        return _configs(dtype)[0]
    block_m, block_n, warps, stages = BI_TILES[torch.float32 if dtype == torch.float32 else torch.bfloat16]
    block_k = 32 if dtype == torch.float32 else 64  # as the autotuned set: fixed per dtype
    meta = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": 8}
    return triton.Config(meta, num_warps=warps, num_stages=stages)


def _fixed_kernel(dtype: torch.dtype):
    """The Triton GEMM with :func:`bi_config` alone (an autotuner over one config never tunes)."""
    if dtype not in _FIXED:
        import triton

        from truefuse.kernels.gemm import _gemm_kernel

        _FIXED[dtype] = triton.autotune(configs=[bi_config(dtype)], key=[])(_gemm_kernel)
    return _FIXED[dtype]


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

    M, K = a.shape
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
    kernel = _fixed_kernel(a.dtype) if "batch_invariant" in fused else _kernel(a.dtype)
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
    kernel[grid](
        a,
        b,
        target,
        pre,
        gb_target if gb is not None else target,
        M,
        N,
        K,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        target.stride(0),
        target.stride(1),
        pre.stride(0),
        pre.stride(1),
        ACCUMULATE=beta1,
        GRAD_ACT=ACT_CODES[grad_act],
        GRAD_BIAS=gb is not None,
        IEEE=a.dtype == torch.float32,
    )
    if gb_target is not gb:
        gb.copy_(gb_target)


BACKEND = GemmBackend(name="triton", capabilities=CAPABILITIES, available=available, product=product)
