"""Batch-invariant attention (docs/attention.md): the reference, the host launchers of
``kernels/attention.py`` and their custom ops (docs/design.md §6.7).

Contract (docs/design.md §1): bounded, forward and every input gradient against
:func:`attention_ref` in float64, the same-dtype ``scaled_dot_product_attention`` (or the
reference in the input dtype, for softcap and windows, which SDPA lacks) as the baseline; and
bitwise batch invariance: a query row's output is the same bits alone, in a right- or left-padded
batch and in decode against a KV cache.
"""

from __future__ import annotations

import math

import torch

from truefuse.config import get_config
from truefuse.ops._launch.custom_op import bwd_call, custom_op, register_backward
from truefuse.ops._launch.eager_grad import eager_grads
from truefuse.ops._launch.fast_launch import fast_launch
from truefuse.ops._launch.triton import kernel_for, sm_count, triton_runs
from truefuse.ops.attention.attention_blocked import attention_blocked, score_transform
from truefuse.ops.attention.attention_config import attention_config, forward_tile
from truefuse.ops.attention.attention_mask import score_mask

#: widest head dim of the kernels (Gemma 2's 256)
MAX_KERNEL_HEAD_DIM = 256


def attention_ref(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    *,
    softcap=None,
    window=None,
    key_start=None,
) -> torch.Tensor:
    """Attention as plain PyTorch computes it, in the inputs' dtype: ``softmax(mask(softcap(q kᵀ ·
    scale))) v`` (SDPA's math, with truefuse's extensions).

    Args:
        query: (B, Hq, Lq, D); key, value: (B, Hk, Lk, D), Hq a multiple of Hk (GQA).
        attn_mask: bool (True = attend) or additive float, broadcastable to (B, Hq, Lq, Lk).
        is_causal: SDPA's top-left causal diagonal (key ≤ query index).
        scale: default 1/√D. softcap: ``softcap · tanh(s / softcap)`` before the mask (Gemma 2).
        window: sliding window: query i sees key j iff i + Lk − Lq − j < window (Mistral, Gemma 2).
        key_start: (B,) int: keys before it are ignored (each sequence's first valid key).

    A query row that sees no key gives zeros (as flash kernels do; SDPA's math gives NaN).
    ``dropout_p`` is not applied (truefuse refuses it, docs/attention.md).
    """
    B, Hq, Lq, D = query.shape
    Hk, Lk = key.shape[1], key.shape[2]
    if Hk != Hq:
        key, value = key.repeat_interleave(Hq // Hk, 1), value.repeat_interleave(Hq // Hk, 1)
    s = query @ key.transpose(-2, -1) * (1.0 / math.sqrt(D) if scale is None else scale)
    s = score_transform(s, attn_mask, softcap or 0.0)
    cols = torch.arange(Lk, device=query.device).expand(B, Lk)
    start = torch.zeros(B, dtype=torch.long, device=query.device) if key_start is None else key_start.to(query.device, torch.long)
    valid = score_mask(torch.arange(Lq, device=query.device), cols, cols >= start[:, None], Lq, Lk, is_causal, window or 0)
    s = s.masked_fill(~valid[:, None], float("-inf"))
    p = torch.softmax(s, dim=-1)
    p = torch.where((s != float("-inf")).any(-1, keepdim=True), p, 0.0)
    return p @ value


def use_kernel(q: torch.Tensor) -> bool:
    """Whether the Triton kernels take ``q``: CUDA fp16/bf16/fp32, or fp32 under the interpreter."""
    return triton_runs(q) and q.shape[-1] <= MAX_KERNEL_HEAD_DIM


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _block_d(D: int) -> int:
    return max(16, 1 << (D - 1).bit_length())


def _mask_args(attn_mask, q):
    """(tensor, kind, 4 strides) of an expanded (B, Hq, Lq, Lk) mask; kind 0 none, 1 bool, 2 float."""
    if attn_mask is None:
        return q, 0, (0, 0, 0, 0)
    return attn_mask, 1 if attn_mask.dtype == torch.bool else 2, attn_mask.stride()


def _common(q, k, window, softcap, is_causal, attn_mask):
    interpreted = get_config().triton_interpret and not q.is_cuda
    cfg = attention_config(_block_d(q.shape[-1]), q.dtype, interpreted)
    mask, kind, ms = _mask_args(attn_mask, q)
    flags = dict(
        BLOCK_D=_block_d(q.shape[-1]),
        CAUSAL=is_causal,
        HAS_WINDOW=window > 0,
        SOFTCAP=softcap > 0,
        MASK_KIND=kind,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        INTERPRETED=interpreted,
    )
    return cfg, mask, ms, flags


def _full_blocks(cfg, flags: dict) -> bool:
    """Whether the three passes skip the mask on the blocks every row sees whole (the table's
    choice; only where no mask tensor and no window decide what a block's rows see)."""
    return cfg.full_blocks and flags["MASK_KIND"] == 0 and not flags["HAS_WINDOW"]


def attention_fwd_launch(q, k, v, attn_mask, key_start, scale, is_causal, window, softcap):
    """The forward kernel: returns (B, Hq, Lq, D) output in q's dtype and (B, Hq, Lq) fp32 lse in
    base 2 (+inf on rows that see no key).

    Decode (at most one query block) on a grid too small for the GPU splits the keys' chunks
    across programs and merges them in a second kernel. The choice follows the shapes and the
    GPU, and may: both ways run the same arithmetic per row (``kernels/attention.py``).
    """
    return fwd_run(q, k, v, attn_mask, key_start, scale, is_causal, window, softcap)[:2]


def fwd_run(q, k, v, attn_mask, key_start, scale, is_causal, window, softcap) -> tuple:
    """:func:`attention_fwd_launch`'s ``(out, lse)`` and the launches that wrote them (``(kernel,
    grid, args, kwargs)`` each, none for an empty output): ``attention_kept.py`` keeps them."""
    out, lse = fwd_outputs(q)
    if out.numel() == 0:
        return out, lse.fill_(float("inf")), []
    launches = fwd_launches(q, k, v, attn_mask, key_start, out, lse, scale, is_causal, window, softcap)
    for kernel, grid, args, kwargs in launches:
        fast_launch(kernel_for(kernel, out), grid, *args, **kwargs)
    return out, lse, launches


def _like(t: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor laid out as ``t`` (``empty_like``), or contiguous where that layout's
    last stride is not 1 (an overlapping ``t``: the kernels take three strides and a unit last one)."""
    out = torch.empty_like(t)
    return out if out.stride(-1) == 1 else torch.empty(t.shape, dtype=t.dtype, device=t.device)


def fwd_outputs(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward's (out, lse), uninitialised: out laid out as q (``empty_like``: a transformers
    query, ``(B, L, H, D)`` memory seen as ``(B, H, L, D)``, gives an output whose
    ``transpose(1, 2).contiguous()`` is no copy, as SDPA's flash kernels give; the gradients
    likewise), lse (B, Hq, Lq) fp32."""
    B, H, Lq, _ = q.shape
    return _like(q), torch.empty((B, H, Lq), dtype=torch.float32, device=q.device)


def fwd_chunk(q: torch.Tensor) -> int:
    """The keys a program of the split forward takes (its chunk): the config's for q's head dim and dtype."""
    return attention_config(_block_d(q.shape[-1]), q.dtype, get_config().triton_interpret and not q.is_cuda).chunk


def fwd_launches(q, k, v, attn_mask, key_start, out, lse, scale, is_causal, window, softcap) -> list[tuple]:
    """:func:`attention_fwd_launch`'s launches into ``out`` and ``lse`` (not empty), as ``(kernel,
    grid, args, kwargs)``: the forward, and where it splits the keys the merge (its partial states
    allocated here), for :func:`fwd_run`."""
    from truefuse.kernels.attention import _attention_fwd_kernel, _attention_fwd_merge_kernel

    B, H, Lq, D = q.shape
    Hk, Lk = k.shape[1], k.shape[2]
    cfg, mask, ms, flags = _common(q, k, window, softcap, is_causal, attn_mask)
    n_chunks = _cdiv(Lk, cfg.chunk)
    block_m, warps = forward_tile(cfg, Lq)
    programs = _cdiv(Lq, block_m) * B * H
    split = n_chunks > 1 and Lq <= block_m and (flags["INTERPRETED"] or programs < sm_count(q.device.index or 0))
    # prefill's accumulator between chunks in a (BLOCK_M, BLOCK_D) tile a program (attention_config.py)
    in_memory = cfg.state_in_memory and not split and n_chunks > 1 and Lq > cfg.small_m
    if split:
        part = q.new_empty((n_chunks, B * H, Lq, flags["BLOCK_D"] + 2), dtype=torch.float32)
    else:
        part = q.new_empty((programs * block_m * flags["BLOCK_D"],) if in_memory else (1,), dtype=torch.float32)
    args = (
        q, k, v, mask, key_start, out, lse, part,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], *ms,
        H, H // Hk, Lq, Lk, D, scale, softcap, window,
    )  # fmt: skip
    kwargs = dict(
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, CHUNK=cfg.chunk, SPLIT=split, **flags, FULL_BLOCKS=_full_blocks(cfg, flags),
        STATE_IN_MEMORY=in_memory, num_warps=warps, num_stages=cfg.fwd_stages,
    )  # fmt: skip
    launches = [(_attention_fwd_kernel, (_cdiv(Lq, block_m), B * H, n_chunks if split else 1), args, kwargs)]
    if split:
        merge = (part, out, lse, *out.stride()[:3], H, Lq, D, n_chunks)
        launches.append(
            (
                _attention_fwd_merge_kernel,
                (_cdiv(Lq, block_m), B * H),
                merge,
                dict(BLOCK_M=block_m, BLOCK_D=flags["BLOCK_D"], num_warps=warps),
            )
        )
    return launches


def attention_bwd_launch(do, q, k, v, out, lse, attn_mask, key_start, scale, is_causal, window, softcap):
    """The backward: delta, then dK/dV over key blocks, then dQ (no atomics). Returns dq, dk, dv in
    the inputs' dtype."""
    from truefuse.kernels.attention import _attention_bwd_delta_kernel, _attention_bwd_dkdv_kernel, _attention_bwd_dq_kernel

    B, H, Lq, D = q.shape
    Hk, Lk = k.shape[1], k.shape[2]
    dq, dk, dv = _like(q), _like(k), _like(v)  # laid out as the inputs (fwd_outputs)
    if dq.numel() == 0 or dk.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    cfg, mask, ms, flags = _common(q, k, window, softcap, is_causal, attn_mask)
    delta = torch.empty(B, H, Lq, dtype=torch.float32, device=q.device)
    fast_launch(
        kernel_for(_attention_bwd_delta_kernel, delta),
        (_cdiv(Lq, cfg.dq_m), B * H),
        out,
        do,
        delta,
        *out.stride()[:3],
        *do.stride()[:3],
        H,
        Lq,
        D,
        BLOCK_M=cfg.dq_m,
        BLOCK_D=flags["BLOCK_D"],
    )
    common = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *ms)
    fast_launch(
        kernel_for(_attention_bwd_dkdv_kernel, dk),
        (_cdiv(Lk, cfg.dkdv_n), B * Hk),
        q,
        k,
        v,
        mask,
        key_start,
        do,
        lse,
        delta,
        dk,
        dv,
        *common,
        *dk.stride()[:3],
        *dv.stride()[:3],
        H,
        Hk,
        H // Hk,
        Lq,
        Lk,
        D,
        scale,
        softcap,
        window,
        BLOCK_M=cfg.dkdv_m,
        BLOCK_N=cfg.dkdv_n,
        **flags,
        FULL_BLOCKS=_full_blocks(cfg, flags),
        num_warps=cfg.dkdv_warps,
        num_stages=cfg.dkdv_stages,
    )
    fast_launch(
        kernel_for(_attention_bwd_dq_kernel, dq),
        (_cdiv(Lq, cfg.dq_m), B * H),
        q,
        k,
        v,
        mask,
        key_start,
        do,
        lse,
        delta,
        dq,
        *common,
        *dq.stride()[:3],
        H,
        H // Hk,
        Lq,
        Lk,
        D,
        scale,
        softcap,
        window,
        BLOCK_M=cfg.dq_m,
        BLOCK_N=cfg.dq_n,
        **flags,
        FULL_BLOCKS=_full_blocks(cfg, flags),
        num_warps=cfg.dq_warps,
        num_stages=cfg.dq_stages,
    )
    return dq, dk, dv


@custom_op("truefuse::attention_fwd", mutates_args=())
def attention_fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    key_start: torch.Tensor,
    scale: float,
    is_causal: bool,
    window: int,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the forward kernel; ``window`` 0 and ``softcap`` 0.0 mean none."""
    return attention_fwd_launch(q, k, v, attn_mask, key_start, scale, is_causal, window, softcap)


@attention_fwd_op.register_fake
def _(q, k, v, attn_mask, key_start, scale, is_causal, window, softcap):
    B, H, Lq, _ = q.shape
    return _like(q), q.new_empty(B, H, Lq, dtype=torch.float32)


@custom_op("truefuse::attention_bwd", mutates_args=())
def attention_bwd_op(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    attn_mask: torch.Tensor | None,
    key_start: torch.Tensor,
    scale: float,
    is_causal: bool,
    window: int,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv for the output gradient ``do``."""
    if do.stride(-1) != 1:
        do = do.contiguous()
    return attention_bwd_launch(do, q, k, v, out, lse, attn_mask, key_start, scale, is_causal, window, softcap)


@attention_bwd_op.register_fake
def _(do, q, k, v, out, lse, attn_mask, key_start, scale, is_causal, window, softcap):
    return _like(q), _like(k), _like(v)


def _setup(ctx, inputs, output):
    q, k, v, attn_mask, key_start, scale, is_causal, window, softcap = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, attn_mask, key_start)
    ctx.args = (scale, is_causal, window, softcap)
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, attn_mask, key_start = ctx.saved_tensors
    if dout is None:
        return None, None, None, None, None, None, None, None, None
    dq, dk, dv = bwd_call(ctx, attention_bwd_op, dout, q, k, v, out, lse, attn_mask, key_start, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None


register_backward(
    attention_fwd_op,
    _backward,
    _setup,
    bwd_ops=(attention_bwd_op,),
    name="attention",
    ref="truefuse.ops.attention.attention.attention_ref",
)


# The PyTorch path as one opaque op while torch.compile traces (autograd/attention.py): traced into
# the graph, Inductor generates its own code for its math (its exp, its reductions) and a row got
# other bits than in eager mode (1 ulp; tests/hf/test_compile_layers.py), so a compiled trainer and
# an eager sampler would not agree. The op runs the eager path; its backward recomputes the forward
# and takes autograd's gradients of it, eager's bits too.
@custom_op("truefuse::attention_pytorch_fwd", mutates_args=())
def attention_pytorch_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    key_start: torch.Tensor,
    scale: float,
    is_causal: bool,
    window: int,
    softcap: float,
) -> torch.Tensor:
    """``attention_blocked``'s output (contiguous)."""
    return attention_blocked(q, k, v, attn_mask, key_start, scale, is_causal, window, softcap).contiguous()


@attention_pytorch_op.register_fake
def _(q, k, v, attn_mask, key_start, scale, is_causal, window, softcap):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@custom_op("truefuse::attention_pytorch_bwd", mutates_args=())
def attention_pytorch_bwd_op(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    key_start: torch.Tensor,
    scale: float,
    is_causal: bool,
    window: int,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (contiguous): autograd's, through the recomputed forward."""
    return eager_grads(
        lambda q, k, v: attention_blocked(q, k, v, attn_mask, key_start, scale, is_causal, window, softcap), (q, k, v), do
    )


@attention_pytorch_bwd_op.register_fake
def _(do, q, k, v, attn_mask, key_start, scale, is_causal, window, softcap):
    cf = torch.contiguous_format
    return torch.empty_like(q, memory_format=cf), torch.empty_like(k, memory_format=cf), torch.empty_like(v, memory_format=cf)


def _pytorch_setup(ctx, inputs, output):
    q, k, v, attn_mask, key_start, *args = inputs
    ctx.save_for_backward(q, k, v, attn_mask, key_start)
    ctx.args = tuple(args)


def _pytorch_backward(ctx, dout):
    q, k, v, attn_mask, key_start = ctx.saved_tensors
    dq, dk, dv = attention_pytorch_bwd_op(dout, q, k, v, attn_mask, key_start, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None


register_backward(
    attention_pytorch_op,
    _pytorch_backward,
    _pytorch_setup,
    bwd_ops=(attention_pytorch_bwd_op,),
    name="attention",
    ref="truefuse.ops.attention.attention.attention_ref",
)
