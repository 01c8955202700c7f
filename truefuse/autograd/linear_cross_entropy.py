"""``truefuse.linear_cross_entropy``: the LM head and its cross-entropy without materializing the
(tokens, V) logits.

Tokens are processed in chunks: a chunk's logits by ``truefuse.gemm``, its loss terms and the
gradient of its logits in closed form (``ops.linear_cross_entropy.chunk_math``, fp32), then the
input gradient by a GEMM into its slice and the weight gradient accumulated across chunks in fp32
inside the GEMM (beta=1). For ``mean`` and ``sum`` the gradients are computed in the forward (when
grad is enabled) and the first backward scales them in place by ``grad_output`` and hands them
over (a later backward, under ``retain_graph``, recomputes them from the saved inputs); ``none`` (a
per-token upstream gradient) recomputes the chunks in the backward instead.

The chunk's loss terms and d_logits come from one Triton kernel (``kernels/cross_entropy.py``:
online softmax over V blocks, fp32 math, d_logits written in place over the logits) on CUDA and
for fp32 under the CPU interpreter; elsewhere from the same math in PyTorch (``chunk_math``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from truefuse.autograd._autocast import as_cast, autocast_disabled, autocast_dtype, cast, wgrad_dtype
from truefuse.autograd._wgrad import WgradState, check_main_grad, deliver_weight_grad
from truefuse.autograd.linear_cross_entropy_gemms import (
    input_grad_gemm,
    logits_buffer,
    logits_gemm,
    vocab_split,
    weight_grad_gemm,
)
from truefuse.config import get_tuning
from truefuse.ops._dtypes import wide_dtype
from truefuse.ops._triton import triton_runs
from truefuse.ops.linear_cross_entropy import (
    LinearCrossEntropyOutput,
    check_args,
    check_targets,
    chunk_kernel,
    chunk_math,
    mean_scales,
    reduce_terms,
    target_weights,
    token_accuracy,
    valid_count,
)
from truefuse.ops.scale import scale_


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


def _chunks(
    cfg: _Cfg,
    x,
    W,
    b,
    t,
    cw,
    s_ce,
    s_z,
    want_grad: tuple[bool, bool, bool],
    dW_out=None,
    dW_accumulate=False,
    keep_d=False,
    check=None,
    w_dtype=None,
):
    """Run every chunk; returns per-token (ce, zl, correct) and (dx, dW, db) as asked.

    ``s_ce`` / ``s_z``: 0-dim scales of the reduction, or (N,) per-token upstream gradients.
    ``dW_out``: write (or with ``dW_accumulate`` add) the weight gradient into this fp32 tensor
    (``main_grad``), chunk after chunk inside the GEMMs, instead of returning it. ``keep_d``: also
    return the d_logits of a single chunk (unscaled by anything but ``s_ce`` / ``s_z``), as the
    (rows, ≥ V) buffer they were written in: the d_logits are its first V columns.
    ``check``: ``check_targets``' finish, called once. The Triton kernel reads a bad target as
    column 0 (memory-safe), so on that path the wait comes after every chunk is queued: the GPU
    has work for the whole time the host waits. The PyTorch path indexes with the targets, so
    there it comes before the first chunk's math (after its logits GEMM is queued).
    ``w_dtype``: the weight parameter's dtype (default ``W``'s; under autocast ``W`` is its cast
    copy): a returned weight gradient is accumulated in fp32 and ends in a dtype the caller
    rounds to it once (``_autocast.wgrad_dtype``)."""
    N = x.shape[0]
    wide = wide_dtype(x)
    gx, gw, gb = want_grad
    any_grad = gx or gw or gb or keep_d
    # Σ w_c serves label smoothing only: a host sync, before the loop, only when both are asked for
    W_sum = float(cw.sum()) if cw is not None and cfg.label_smoothing > 0 else float(cfg.V)
    ce = torch.empty(N, dtype=wide, device=x.device)
    zl = torch.empty(N, dtype=wide, device=x.device)
    correct = torch.empty(N, dtype=torch.bool, device=x.device)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if gx else None  # contiguous: chunks' GEMMs write rows of it
    # d_weight accumulates across chunks inside the GEMM (beta=1): in fp32 (one rounding at the
    # end, as accurate as one GEMM over all tokens; V*H*4 bytes more) or in the weight's dtype
    # (no extra memory; one rounding per chunk). One chunk needs no accumulator: its GEMM writes
    # d_weight in the weight's dtype, accumulating in fp32 inside (the plain path's GEMM).
    # Under autocast (an fp32 weight, operands cast to bf16) "the weight's dtype" is the parameter's:
    # its one GEMM writes fp32, and without fp32_weight_grad the chunks accumulate in fp32 too.
    w_dtype = W.dtype if w_dtype is None else w_dtype
    one_chunk = N <= cfg.chunk
    acc_dtype = wide if cfg.fp32_weight_grad and not one_chunk else wgrad_dtype(x.dtype, w_dtype)
    direct = one_chunk and acc_dtype == x.dtype  # the one GEMM returns the gradient in its dtype
    dW = torch.empty(W.shape, dtype=acc_dtype, device=x.device) if gw and not direct and dW_out is None else None
    db = torch.zeros(cfg.V, dtype=wide, device=x.device) if gb else None
    per_token = s_ce.dim() == 1
    chunk = _kernel_chunk if triton_runs(x) else _torch_chunk
    d = full = None
    for i, start in enumerate(range(0, N, cfg.chunk)):
        # the previous chunk's logits go before this chunk's are allocated, not after: one
        # chunk of logits alive at a time (2.1 GB less peak at 16384 x 128256 x 4096 in 8192s)
        logits = d = full = None
        sl = slice(start, min(start + cfg.chunk, N))
        xc = x[sl]
        split = vocab_split(xc, cfg.V)
        # a split GEMM would get the bias from cuBLAS after the product's rounding (1.41x the
        # logits' error, measured): the loss kernel adds it in fp32 instead
        kernel_bias = b if split is not None else None
        full = None if split is None else logits_buffer(xc.shape[0], cfg.V, xc)
        logits = logits_gemm(xc, W, None if split is not None else b, None if full is None else full[:, : cfg.V], split)
        if check is not None and i == 0 and chunk is _torch_chunk:
            check()
        scales = (s_ce[sl], s_z[sl]) if per_token else (s_ce, s_z)
        # the chunk's loss terms into ce/zl/correct, and d_logits in the input dtype (the GEMM
        # operands are in the input dtype, as the plain path's are), or None without gradients
        d = chunk(cfg, logits, t[sl], cw, ce[sl], zl[sl], correct[sl], *scales, W_sum, any_grad, kernel_bias)
        if d is None:
            continue
        if gb:
            db += torch.sum(d, dim=0, dtype=wide)
        if gx:
            input_grad_gemm(d, W, dx[sl], split)
        if gw and dW_out is not None:
            weight_grad_gemm(d, xc, dW_out, dW_accumulate or i > 0, split)
        elif gw and direct:
            dW = weight_grad_gemm(d, xc, None, False, split)
        elif gw:
            weight_grad_gemm(d, xc, dW, i > 0, split)
    if check is not None and chunk is _kernel_chunk:
        check()
    if N == 0 and gw:  # no tokens, no chunk ran: the weight gradient is zero, as torch's
        if dW_out is None:
            dW = torch.zeros(W.shape, dtype=w_dtype, device=W.device)
        elif not dW_accumulate:  # written (overwrite_main_grad), not added to
            dW_out.zero_()
    # kept whole (padding included): contiguous, so the backward's scale_ is one in-place pass
    return ce, zl, correct, (dx, dW, db, (d if full is None else full) if keep_d else None)


def _in_dtypes(grads, w_dtype, b_dtype):
    """``_chunks``' gradients (dx, dW, db, d) with dW and db in the parameters' dtypes."""
    dx, dW, db, d = grads
    return dx, None if dW is None else dW.to(w_dtype), None if db is None else db.to(b_dtype), d


def _torch_chunk(cfg, logits, t, cw, ce, zl, ok, s_ce, s_z, w_sum, want_grad, bias=None):
    """The chunk in PyTorch (``chunk_math``, fp32 or fp64): the path off CUDA and for fp64.
    ``bias``: added to the logits here (None: the GEMM added it)."""
    z = logits.to(wide_dtype(logits))
    if bias is not None:
        z = z + bias.to(z.dtype)
    if cfg.softcap is not None:
        z = cfg.softcap * torch.tanh(z / cfg.softcap)
    c_ce, c_zl, c_ok, g = chunk_math(
        z, t, t != cfg.ignore_index, cw, V=cfg.V, W_sum=w_sum, label_smoothing=cfg.label_smoothing, z_loss=cfg.z_loss,
        softcap=cfg.softcap, s_ce=s_ce, s_z=s_z, want_grad=want_grad,
    )  # fmt: skip
    ce.copy_(c_ce), zl.copy_(c_zl), ok.copy_(c_ok)
    return None if g is None else g.to(logits.dtype)


def _kernel_chunk(cfg, logits, t, cw, ce, zl, ok, s_ce, s_z, w_sum, want_grad, bias=None):
    """The chunk in one Triton kernel (``ops.linear_cross_entropy.chunk_kernel``); d_logits is
    written over the logits in place. ``bias``: added by the kernel in fp32 (None: the GEMM added it)."""
    return chunk_kernel(
        logits, t, cw, ce, zl, ok, s_ce, s_z, V=cfg.V, ignore_index=cfg.ignore_index, w_sum=w_sum,
        label_smoothing=cfg.label_smoothing, z_loss=cfg.z_loss, softcap=cfg.softcap, want_grad=want_grad, bias=bias,
    )  # fmt: skip


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Inputs: x (N, H), W (V, H), bias (V,) or None, target (N,), class weight (V,) fp32 or None,
    the config, the weight's docs/design.md §2 state (None: plain), and the autocast dtype (None
    outside autocast): under autocast x arrives cast, the GEMMs take W and the bias cast likewise
    (``_autocast``), and their gradients come back in the parameters' dtypes, the weight's
    accumulated in fp32 and rounded once.

    Under fused ``main_grad`` accumulation or a delayed weight gradient (docs/design.md §2) the weight
    gradient is left to the backward, where ``grad_output`` is known (``main_grad`` holds other
    contributions: it can only be added to once, already scaled), and handed to
    ``deliver_weight_grad``. With one chunk the forward keeps the chunk's d_logits for it: the
    backward scales them and the one GEMM runs then (or in ``backward_dw()``). With several
    chunks, or with ``none``, the chunks are recomputed: in the backward's pass (fused) or in
    ``backward_dw()`` (delayed, after the backward's pass for d_input and d_bias).

    Repeated backward (``retain_graph``): a returned gradient is never written by this function
    afterwards (autograd may have made it a leaf's ``.grad``). The forward's gradients serve the
    first backward only; every later one recomputes them from the saved inputs (x, W, bias,
    targets, class weights, scales), the same bits, scaled by its own ``grad_output``. Saving x
    keeps the input alive until the graph is freed (N·H elements, where nothing else holds it)."""

    @staticmethod
    @autocast_disabled
    def forward(ctx, x, W, b, t, cw, cfg: _Cfg, wstate: WgradState | None, dtype):
        wide = wide_dtype(x)
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], b is not None and ctx.needs_input_grad[2])
        deferred = wstate is not None and not wstate.plain and needs[1]  # fused and/or delayed
        if deferred and wstate.fuse_wgrad_accumulation:
            check_main_grad(W, "linear_weight")  # a clear error now, not in the backward
        # the parameter (for §2 and the gradients' dtypes); the GEMMs take W and b cast under autocast
        Wp, ctx.b_dtype = W, None if b is None else b.dtype
        W, b = cast(W, dtype), cast(b, dtype)
        # Few small kernels around the loop (each is a launch; per call they cost ~2% at
        # 8192 x 32000 x 4096 against torch.compile's fused ones): one count of the valid tokens
        # serves mean's scales, the accuracy, and the target check reuses the mask.
        valid = t != cfg.ignore_index
        n = valid_count(valid, wide)
        # one chunk: its d_logits serve the weight's GEMM (no tokens: no chunk, nothing to keep)
        keep_d = deferred and 0 < x.shape[0] <= cfg.chunk
        now = cfg.reduction != "none" and any(needs) and (not deferred or keep_d)
        if cfg.reduction == "mean":
            s_ce, s_z = mean_scales(n, None if cw is None else target_weights(t, cw, cfg.ignore_index, wide)[1])
        else:
            s_ce = s_z = torch.ones((), dtype=wide, device=x.device)
        want = (needs[0], needs[1] and not deferred, needs[2]) if now else (False, False, False)
        checked = check_targets(t, cfg.V, cfg.ignore_index, valid)  # started here, finished inside _chunks
        ce, zl, correct, grads = _chunks(
            cfg, x, W, b, t, cw, s_ce, s_z, want, keep_d=keep_d and now, check=checked, w_dtype=Wp.dtype
        )
        loss, z_part = reduce_terms(ce, zl, cfg.reduction, (s_ce, s_z))
        acc = token_accuracy(correct, n).to(wide)  # the chunks mark valid tokens only
        ctx.cfg, ctx.needs, ctx.now, ctx.wstate, ctx.deferred = cfg, needs, now, wstate, deferred
        ctx.want, ctx.keep_d, ctx.grads = want, keep_d, None
        if now:
            # Plain attributes, not saved tensors: the first backward scales them in place and
            # hands them to autograd (dx may become the leaf's .grad, the same storage), which may
            # then write them; ctx forgets them there, so nothing here reads them again and no
            # saved-tensor version check trips on that write.
            ctx.grads = _in_dtypes(grads, Wp.dtype, ctx.b_dtype)
        if any(needs):
            # what a later backward (retain_graph) recomputes from; references, not copies (W and
            # Wp are one tensor outside autocast)
            ctx.save_for_backward(x, W, b, t, cw, s_ce, s_z, Wp)
        ctx.mark_non_differentiable(z_part, acc)
        return loss, z_part, acc

    @staticmethod
    @autocast_disabled
    def backward(ctx, g_loss, g_z, g_acc):
        cfg = ctx.cfg
        if ctx.now:
            # Gradients computed in the forward: scale them in place by grad_output and hand them
            # over. A factor of 1 (the usual grad_output) costs no pass over them and no host sync
            # (ops/scale.py): the pass took 2.2 ms of 44 at 8192 x 128256 x 4096 on the H200.
            # The first backward takes the forward's and ctx lets go of them: autograd owns what
            # it gets (a leaf's .grad may be dx itself, which later accumulations write in
            # place), and the delayed weight GEMM's closure alone holds d. A later backward
            # (retain_graph) recomputes them from the saved inputs as the forward did (the same
            # bits), then scales them by its own grad_output likewise.
            if ctx.grads is not None:
                (dx, dW, db, d), ctx.grads = ctx.grads, None
            else:
                x, W, b, t, cw, s_ce, s_z, Wp = ctx.saved_tensors
                grads = _chunks(cfg, x, W, b, t, cw, s_ce, s_z, ctx.want, keep_d=ctx.keep_d, w_dtype=Wp.dtype)[3]
                dx, dW, db, d = _in_dtypes(grads, Wp.dtype, ctx.b_dtype)
            g = g_loss.to(wide_dtype(g_loss))
            for tensor in (dx, dW, db, d):
                if tensor is not None:
                    scale_(tensor, g)
            if ctx.deferred:
                saved = ctx.saved_tensors
                x, Wp = saved[0], saved[7]

                def compute(out, accumulate):
                    split = vocab_split(x, cfg.V)
                    if out is not None:  # main_grad
                        return weight_grad_gemm(d[:, : cfg.V], x, out, accumulate, split)
                    odt = wgrad_dtype(x.dtype, Wp.dtype)  # autocast: fp32 out of the cast operands
                    new = None if odt == d.dtype else torch.empty(Wp.shape, dtype=odt, device=x.device)
                    return weight_grad_gemm(d[:, : cfg.V], x, new, False, split).to(Wp.dtype)

                dW = deliver_weight_grad(Wp, "linear_weight", compute, ctx.wstate)
            return dx, dW, db, None, None, None, None, None
        x, W, b, t, cw, s_ce, s_z, Wp = ctx.saved_tensors
        if cfg.reduction != "none":  # fused or delayed, several chunks: recompute, scaled by g
            g = g_loss.to(s_ce.dtype)
            s_ce, s_z = s_ce * g, s_z * g
        else:
            # delayed: a copy (N values), since backward_dw() reads it after this backward
            # returned, when the caller may have written its upstream tensor
            delayed = ctx.deferred and ctx.wstate.delay_wgrad_compute
            s_ce = s_z = g_loss.reshape(-1).to(wide_dtype(x), copy=delayed)
        if not ctx.deferred:
            _, _, _, (dx, dW, db, _) = _chunks(cfg, x, W, b, t, cw, s_ce, s_z, ctx.needs, w_dtype=Wp.dtype)
            dW = None if dW is None else dW.to(Wp.dtype)
        elif ctx.wstate.delay_wgrad_compute:
            # d_input and d_bias now; the weight's pass over the chunks waits for backward_dw()
            _, _, _, (dx, _, db, _) = _chunks(cfg, x, W, b, t, cw, s_ce, s_z, (ctx.needs[0], False, ctx.needs[2]))

            def compute(out, accumulate):
                _, _, _, (_, dW_new, _, _) = _chunks(
                    cfg, x, W, b, t, cw, s_ce, s_z, (False, True, False), dW_out=out, dW_accumulate=accumulate,
                    w_dtype=Wp.dtype,
                )  # fmt: skip
                return None if dW_new is None else dW_new.to(Wp.dtype)

            dW = deliver_weight_grad(Wp, "linear_weight", compute, ctx.wstate)
        else:
            got = {}

            def compute(out, accumulate):
                # one pass: d_input and d_bias ride along with the chunks' GEMMs into main_grad
                _, _, _, (got["dx"], dW_new, got["db"], _) = _chunks(
                    cfg, x, W, b, t, cw, s_ce, s_z, ctx.needs, dW_out=out, dW_accumulate=accumulate, w_dtype=Wp.dtype
                )
                return dW_new

            dW = deliver_weight_grad(Wp, "linear_weight", compute, ctx.wstate)
            dx, db = got["dx"], got["db"]
        db = None if db is None else db.to(ctx.b_dtype)
        return dx, dW, db, None, None, None, None, None


def _default_chunk(N: int, V: int, H: int, itemsize: int, fp32_accumulator: bool) -> int:
    """Tokens per chunk when ``chunk_size`` is None.

    The logits' budget is the ``chunk_bytes`` tuning knob (``truefuse.config.Tuning``, 512 MiB: on
    the H200 at 8192 x 128256 x 4096 it picks 2048-token chunks, 47.3 ms against 45.4 for 4096 with
    1 GiB more peak; docs/benchmarks.md), or with an fp32 weight-gradient accumulator its V·H·4
    bytes when that is more: memory chunking holds anyway. All N when every token's logits fit (the
    three GEMMs of the plain path and one loss pass, nothing re-read per chunk), else the largest
    power of two of tokens that fits (at least 1). Each chunk re-reads and re-writes the fp32
    accumulator (8·V·H bytes) beside a weight-gradient GEMM of 2·chunk·V·H flops, so larger chunks
    cost less time: at 16384 x 128256 x 4096 (H200, bf16) chunks of 2048 / 4096 / 8192 took
    1.120 / 1.059 / 1.054x the three GEMMs, torch.compile of the plain path 1.065x (8192 is chosen
    there, the accumulator's budget; docs/benchmarks.md)."""
    chunk_bytes = get_tuning().chunk_bytes
    budget = max(chunk_bytes, V * H * 4) if fp32_accumulator else chunk_bytes
    if N * V * itemsize <= budget:
        return max(1, N)
    fit = max(1, budget // (itemsize * max(V, 1)))
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
    fuse_wgrad_accumulation: bool = False,
    wgrad_state: WgradState | None = None,
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
        chunk_size: tokens per chunk. Default: all tokens in one chunk when their logits take no
            more memory than chunking would (the ``chunk_bytes`` tuning knob, 512 MiB, or the fp32 weight-gradient
            accumulator's V·H·4 bytes when that is needed: 8192 tokens at V = 128256, H = 4096 in
            bf16), else the largest power of two of tokens whose logits fit in that budget.
        fp32_weight_grad: accumulate the weight gradient across chunks in fp32 and round once
            (default: as accurate as the plain path; V·H·4 bytes of memory), or in the weight's
            dtype (no extra memory, one rounding per chunk; measured in docs/benchmarks.md). A
            single chunk needs neither: its one GEMM accumulates in fp32 and rounds once.
        fuse_wgrad_accumulation: the weight gradient goes to ``linear_weight.main_grad`` (fp32,
            Megatron's convention) inside the GEMMs, per docs/design.md §2 (what autograd gets: None, or
            a cached zero tensor when the weight has ``grad_added_to_main_grad``; with
            ``overwrite_main_grad`` it is written, not added). With one chunk (the default rule
            above) the forward keeps its d_logits for the backward's GEMM; with several chunks
            (or ``none``) the backward recomputes them (one more logits GEMM).
        wgrad_state: the weight's docs/design.md §2 state (``LinearCrossEntropyLoss`` passes its own: it
            holds ``delay_wgrad_compute`` and the queue ``backward_dw()`` runs); default: a fresh
            one from ``fuse_wgrad_accumulation``.

    Returns:
        The loss, or a :class:`LinearCrossEntropyOutput` when an extra is asked for. Differentiable
        in ``input``, ``linear_weight`` and ``linear_bias``; the weight gradient is accumulated in
        fp32 across chunks and rounded once. When every target is ignored, ``mean`` is 0; with no
        tokens at all the loss is 0 (``none``: empty) and the gradients are zeros. Backward may
        run several times (``retain_graph``): each adds its own gradient, as the reference's does.

    Autocast: as ``F.cross_entropy(F.linear(input, W, b).float(), target)`` under ``torch.autocast``:
    the GEMMs on input, weight and bias cast to the autocast dtype, the loss in fp32; gradients in
    the input's and parameters' dtypes (docs/linear.md, "Autocast").

    Non-finite values give what the reference gives (``F.cross_entropy``): a NaN logit makes its
    token's loss, z-loss and d_logits NaN and its argmax is the first NaN (``torch.argmax``); a
    +inf logit, or a row of -inf, makes the token's cross-entropy and d_logits NaN (its
    log_softmax is), its z-loss term z_loss·lse² +inf (NaN for z_loss = 0, 0·inf, as in the
    reference); a -inf logit elsewhere just has probability 0. An ignored
    token never reaches the loss: an inf or NaN hidden state there leaves it finite. Its d_logits
    are 0, except NaN where its log_softmax is NaN (a ±inf / NaN logit, no softcap), as torch's
    backward gives (0 − exp(NaN)·0): then its d_input row and all of d_weight and d_bias are NaN,
    exactly as the reference's. With softcap its logits are finite: d_input's row is 0 and
    d_weight is NaN only in the columns where the hidden state is inf (0·inf in the weight GEMM,
    as in ``F.linear``'s backward).

    Raises:
        TypeError / ValueError naming the argument; ``ValueError`` for a target outside [0, V)
        other than ``ignore_index`` (the host waits for that check only, not for the stream).
    """
    # under torch.autocast F.linear's operands are cast to its dtype (the input here, differentiably;
    # the weight and bias inside the Function, which needs the parameters): checked as cast
    dtype = autocast_dtype(input.device) if isinstance(input, torch.Tensor) else None
    input = cast(input, dtype)
    check_args(
        input, as_cast(linear_weight, dtype), target, as_cast(linear_bias, dtype), weight, reduction, ignore_index,
        label_smoothing, z_loss, softcap, chunk_size,
    )  # fmt: skip
    V = linear_weight.shape[0]
    t = target.reshape(-1).to(torch.int64)  # checked against V in the forward (check_targets)
    x = input.reshape(-1, input.shape[-1])
    cw = None if weight is None else weight.detach().to(wide_dtype(input))
    wgrad = torch.is_grad_enabled() and linear_weight.requires_grad
    if wgrad_state is None and fuse_wgrad_accumulation:
        wgrad_state = WgradState(fuse_wgrad_accumulation=True)
    elif fuse_wgrad_accumulation and not wgrad_state.fuse_wgrad_accumulation:  # None: plain (no state to trace)
        raise ValueError("fuse_wgrad_accumulation=True contradicts wgrad_state (pass one or the other)")
    cfg = _Cfg(
        V,
        reduction,
        int(ignore_index),
        float(label_smoothing),
        float(z_loss),
        softcap,
        chunk_size
        or _default_chunk(
            x.shape[0],
            V,
            x.shape[1],
            x.element_size(),
            # the same budget with main_grad fusion: one chunk keeps its d_logits instead of
            # recomputing the chunks in the backward (one more logits GEMM)
            wgrad and bool(fp32_weight_grad),
        ),
        bool(fp32_weight_grad),
    )
    loss, z_part, acc = LinearCrossEntropyFunction.apply(x, linear_weight, linear_bias, t, cw, cfg, wgrad_state, dtype)
    if reduction == "none":
        loss, z_part = loss.view(target.shape), z_part.view(target.shape)
    if not (return_z_loss or return_token_accuracy):
        return loss
    return LinearCrossEntropyOutput(loss, z_part if return_z_loss else None, acc if return_token_accuracy else None)
