"""``truefuse.linear_cross_entropy``: the LM head and its cross-entropy without materializing the
(tokens, V) logits.

Tokens are processed in chunks: a chunk's logits by ``truefuse.gemm``, its loss terms and the
gradient of its logits in closed form (``ops.linear_cross_entropy.chunk_math``, fp32), then the
input gradient by a GEMM into its slice and the weight gradient accumulated across chunks in fp32
inside the GEMM (beta=1). For ``mean`` and ``sum`` the gradients are computed in the forward (when
grad is enabled) and the backward scales them by ``grad_output``; ``none`` (a per-token upstream
gradient) recomputes the chunks in the backward instead.

The chunk's loss terms and d_logits come from one Triton kernel (``kernels/cross_entropy.py``:
online softmax over V blocks, fp32 math, d_logits written in place over the logits) on CUDA and
for fp32 under the CPU interpreter; elsewhere from the same math in PyTorch (``chunk_math``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from truefuse.ops._triton import triton_runs
from truefuse.ops.gemm import gemm
from truefuse.ops.linear_cross_entropy import (
    LinearCrossEntropyOutput,
    _reduce,
    check_args,
    check_targets,
    chunk_math,
)

#: Logits budget of one chunk (bytes in the input dtype) when ``chunk_size`` is None. Measured on
#: the H200 (docs/benchmarks.md): at 8192 x 128256 x 4096 chunks of 512 / 1024 / 2048 / 4096 tokens
#: took 58.6 / 50.2 / 47.3 / 45.4 ms, the last with 1 GiB more peak memory; 512 MiB picks 2048 there.
CHUNK_BYTES = 512 << 20


@dataclass(frozen=True)
class _Cfg:
    V: int
    reduction: str
    ignore_index: int
    label_smoothing: float
    z_loss: float
    softcap: float | None
    chunk: int
    fp32_weight_grad: bool = True


@contextlib.contextmanager
def _fp32_reductions():
    """cuBLAS may reduce split-K partials in bf16/fp16 (PyTorch's default allows it). Small chunks
    made it do so and lost accuracy against the plain path (measured: loss error 1.6x at 16-token
    chunks on the H200), so the op's GEMMs forbid it."""
    m = torch.backends.cuda.matmul
    old = m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction
    m.allow_bf16_reduced_precision_reduction = m.allow_fp16_reduced_precision_reduction = False
    try:
        yield
    finally:
        m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction = old


def _chunks(cfg: _Cfg, x, W, b, t, cw, s_ce, s_z, want_grad: tuple[bool, bool, bool]):
    with _fp32_reductions():
        return _chunks_body(cfg, x, W, b, t, cw, s_ce, s_z, want_grad)


def _chunks_body(cfg: _Cfg, x, W, b, t, cw, s_ce, s_z, want_grad: tuple[bool, bool, bool]):
    """Run every chunk; returns per-token (ce, zl, correct) and (dx, dW fp32, db fp32) as asked."""
    N = x.shape[0]
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    gx, gw, gb = want_grad
    any_grad = gx or gw or gb
    valid = t != cfg.ignore_index
    W_sum = float(cw.sum()) if cw is not None else float(cfg.V)
    ce = torch.empty(N, dtype=wide, device=x.device)
    zl = torch.empty(N, dtype=wide, device=x.device)
    correct = torch.empty(N, dtype=torch.bool, device=x.device)
    dx = torch.empty_like(x) if gx else None
    # d_weight accumulates across chunks inside the GEMM (beta=1): in fp32 (one rounding at the
    # end, as accurate as one GEMM over all tokens; V*H*4 bytes more) or in the weight's dtype
    # (no extra memory; one rounding per chunk)
    acc_dtype = wide if cfg.fp32_weight_grad else W.dtype
    dW = torch.empty(W.shape, dtype=acc_dtype, device=x.device) if gw else None
    db = torch.zeros(cfg.V, dtype=wide, device=x.device) if gb else None
    per_token = torch.is_tensor(s_ce) and s_ce.dim() == 1
    kernel = triton_runs(x)
    for i, start in enumerate(range(0, N, cfg.chunk)):
        sl = slice(start, min(start + cfg.chunk, N))
        xc = x[sl]
        logits = gemm(xc, W.t(), bias=b)
        if kernel:  # the chunk's loss terms, and d_logits in place (Triton)
            d = _kernel_chunk(cfg, logits, t[sl], cw, ce[sl], zl[sl], correct[sl], s_ce, s_z, W_sum, any_grad, per_token, sl)
            if d is None:
                continue
            if gb:
                db += torch.sum(d, dim=0, dtype=wide)
            if gx:
                dx[sl] = gemm(d, W)
            if gw:
                gemm(d.t(), xc, out=dW, accumulate=i > 0)
            continue
        z = logits.to(wide)
        del logits
        if cfg.softcap is not None:
            z = cfg.softcap * torch.tanh(z / cfg.softcap)
        c_ce, c_zl, c_ok, g = chunk_math(
            z, t[sl], valid[sl], cw, V=cfg.V, W_sum=W_sum, label_smoothing=cfg.label_smoothing, z_loss=cfg.z_loss,
            softcap_z=None if cfg.softcap is None else (cfg.softcap, z),
            s_ce=s_ce[sl] if per_token else s_ce, s_z=s_z[sl] if per_token else s_z, want_grad=any_grad,
        )  # fmt: skip
        ce[sl], zl[sl], correct[sl] = c_ce, c_zl, c_ok
        if g is None:
            continue
        if gb:
            db += g.sum(0)
        d = g.to(x.dtype)  # the GEMM operands are in the input dtype, as the plain path's are
        del g, z
        if gx:
            dx[sl] = gemm(d, W)
        if gw:
            gemm(d.t(), xc, out=dW, accumulate=i > 0)
    return ce, zl, correct, (dx, dW, db)


def _kernel_chunk(cfg, logits, t, cw, ce, zl, ok, s_ce, s_z, w_sum, want_grad, per_token, sl):
    from truefuse.kernels.cross_entropy import _lce_chunk_kernel

    C = logits.shape[0]
    if C == 0:
        return None
    ok_u8 = torch.empty(C, dtype=torch.uint8, device=logits.device)
    s_ce_t = s_ce[sl] if per_token else s_ce
    s_z_t = s_z[sl] if per_token else s_z
    _lce_chunk_kernel[(C,)](
        logits, logits.stride(0), t, cw if cw is not None else ce, ce, zl, ok_u8, s_ce_t.float().contiguous(),
        s_z_t.float().contiguous(), cfg.V, cfg.ignore_index, w_sum, cfg.label_smoothing, cfg.z_loss,
        cfg.softcap or 1.0, HAS_CW=cw is not None, SMOOTH=cfg.label_smoothing > 0, SOFTCAP=cfg.softcap is not None,
        WANT_GRAD=want_grad, PER_TOKEN=per_token, BLOCK_V=4096 if logits.is_cuda else 64, num_warps=8,
    )  # fmt: skip
    ok.copy_(ok_u8.bool())
    return logits if want_grad else None


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Inputs: x (N, H), W (V, H), bias (V,) or None, target (N,), class weight (V,) fp32 or None."""

    @staticmethod
    def forward(ctx, x, W, b, t, cw, cfg: _Cfg):
        wide = torch.float64 if x.dtype == torch.float64 else torch.float32
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], b is not None and ctx.needs_input_grad[2])
        valid = t != cfg.ignore_index
        t_safe = torch.where(valid, t, 0)
        class_w_t = (cw[t_safe].to(wide) if cw is not None else torch.ones(t.shape, dtype=wide, device=t.device)) * valid
        now = cfg.reduction != "none" and any(needs)
        if cfg.reduction == "mean":
            denom, n = class_w_t.sum(), valid.sum().to(wide)
            s_ce = torch.where(denom > 0, 1 / torch.where(denom > 0, denom, 1), 0)
            s_z = torch.where(n > 0, 1 / torch.clamp(n, min=1), 0)
        else:
            s_ce = s_z = torch.ones((), dtype=wide, device=x.device)
        ce, zl, correct, grads = _chunks(cfg, x, W, b, t, cw, s_ce, s_z, needs if now else (False, False, False))
        loss, z_part = _reduce(ce, zl, valid, class_w_t, cfg.reduction)
        n = valid.sum()
        acc = torch.where(n > 0, correct.sum() / torch.clamp(n, min=1), 0.0).to(wide)
        ctx.cfg, ctx.needs, ctx.now = cfg, needs, now
        if now:
            dx, dW, db = grads
            dW = None if dW is None else dW.to(W.dtype)
            db = None if db is None else db.to(b.dtype)
            ctx.save_for_backward(dx, dW, db)
            ctx.scale = torch.ones((), dtype=wide, device=x.device)  # the factor already applied
        elif any(needs):
            ctx.save_for_backward(x, W, b, t, cw)
        ctx.mark_non_differentiable(z_part, acc)
        return loss, z_part, acc

    @staticmethod
    def backward(ctx, g_loss, g_z, g_acc):
        cfg = ctx.cfg
        if ctx.now:
            # Scale the saved gradients in place (through .data: no version bump, no copy, so
            # autograd can take them as .grad without a clone). Tracking the factor already
            # applied keeps retain_graph and repeated backward right; a factor of 1 is exact.
            g = g_loss.to(ctx.scale.dtype)
            factor = g / ctx.scale
            ctx.scale = g.clone()
            out = []
            for tensor in ctx.saved_tensors:
                if tensor is not None:
                    tensor.data.mul_(factor)
                out.append(tensor)
            dx, dW, db = out
        else:
            x, W, b, t, cw = ctx.saved_tensors
            wide = torch.float64 if x.dtype == torch.float64 else torch.float32
            s = g_loss.reshape(-1).to(wide)
            _, _, _, (dx, dW, db) = _chunks(cfg, x, W, b, t, cw, s, s, ctx.needs)
            dW = None if dW is None else dW.to(W.dtype)
            db = None if db is None else db.to(b.dtype)
        return dx, dW, db, None, None, None


def _default_chunk(N: int, V: int, itemsize: int) -> int:
    """The largest power of two of tokens whose logits fit in CHUNK_BYTES (at least 1, at most N)."""
    fit = max(1, CHUNK_BYTES // (itemsize * max(V, 1)))
    return max(1, min(N, 1 << (fit.bit_length() - 1)))


def linear_cross_entropy(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    linear_bias: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    reduction: str = "mean",
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
    return_z_loss: bool = False,
    return_token_accuracy: bool = False,
    chunk_size: int | None = None,
    fp32_weight_grad: bool = True,
):
    """Cross-entropy of ``input @ linear_weightᵀ + linear_bias`` against ``target``, in chunks of tokens.

    Args:
        input: (..., H) hidden states, fp16 / bf16 / fp32 / fp64.
        linear_weight: (V, H), the input's dtype. linear_bias: (V,) or None.
        target: (...) int64/int32 class indices; ``ignore_index`` marks tokens that do not count.
        weight: (V,) per-class weights (any float dtype; used in fp32), or None.
        reduction: ``mean`` | ``sum`` | ``none`` (per token, shaped like ``target``).
        label_smoothing, z_loss, softcap: as in :func:`truefuse.ops.linear_cross_entropy.linear_cross_entropy_ref`.
        return_z_loss, return_token_accuracy: also return those (not differentiable).
        chunk_size: tokens per chunk (default: the largest power of two whose logits fit in
            ``CHUNK_BYTES``, 512 MiB: 2048 tokens at V = 128256 in bf16).
        fp32_weight_grad: accumulate the weight gradient across chunks in fp32 and round once
            (default: as accurate as the plain path; V·H·4 bytes of memory), or in the weight's
            dtype (no extra memory, one rounding per chunk; measured in docs/benchmarks.md).

    Returns:
        The loss, or a :class:`LinearCrossEntropyOutput` when an extra is asked for. Differentiable
        in ``input``, ``linear_weight`` and ``linear_bias``; the weight gradient is accumulated in
        fp32 across chunks and rounded once. When every target is ignored, ``mean`` is 0.

    Raises:
        TypeError / ValueError naming the argument; ``ValueError`` for a target outside [0, V)
        other than ``ignore_index`` (checked with one host sync).
    """
    check_args(
        input, linear_weight, target, linear_bias, weight, reduction, ignore_index, label_smoothing, z_loss, softcap, chunk_size
    )
    V = linear_weight.shape[0]
    t = target.reshape(-1).to(torch.int64)
    check_targets(t, V, ignore_index)
    x = input.reshape(-1, input.shape[-1])
    wide = torch.float64 if input.dtype == torch.float64 else torch.float32
    cw = None if weight is None else weight.detach().to(wide)
    cfg = _Cfg(
        V,
        reduction,
        int(ignore_index),
        float(label_smoothing),
        float(z_loss),
        softcap,
        chunk_size or _default_chunk(x.shape[0], V, x.element_size()),
        bool(fp32_weight_grad),
    )
    loss, z_part, acc = LinearCrossEntropyFunction.apply(x, linear_weight, linear_bias, t, cw, cfg)
    if reduction == "none":
        loss, z_part = loss.view(target.shape), z_part.view(target.shape)
    if not (return_z_loss or return_token_accuracy):
        return loss
    return LinearCrossEntropyOutput(loss, z_part if return_z_loss else None, acc if return_token_accuracy else None)
