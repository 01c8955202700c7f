"""The cross-entropy as the chunked head's per-chunk loss (``ops/lm_head/chunked_head.py``).

:class:`CrossEntropyChunks` holds one pass's per-token outputs (cross-entropy, z-loss, argmax ==
target) and the gradient scales. Each chunk runs in one Triton kernel (``kernels/
linear_cross_entropy.py``: online softmax over V blocks, fp32 math, d_logits written over the
logits) on CUDA and for fp32 under the CPU interpreter (``chunk_kernel``); elsewhere the same math
in PyTorch (``chunk_math``), fp32 or fp64.
"""

from __future__ import annotations

import torch

from truefuse.ops._launch.custom_op import custom_op, launch
from truefuse.ops._launch.dtypes import wide_dtype
from truefuse.ops._launch.triton import recorded, triton_runs
from truefuse.ops.lm_head.linear_cross_entropy import LinearCrossEntropyOptions


class CrossEntropyChunks:
    """One pass of the cross-entropy over the chunks of N tokens (a ``ChunkLoss``).

    Args:
        opts: the loss's options. V: classes. t: (N,) int64 targets. cw: (V,) class weights in
            the wide dtype, or None.
        s_ce, s_z: 0-dim scales of the reduction, or (N,) per-token upstream gradients, of the
            cross-entropy and z-loss terms' gradients (device tensors: no host sync).
        like: the input (N, H): its device and dtype pick the kernel or PyTorch.
        check: ``check_targets``' finish, called once. The kernel reads a bad target as column 0
            (memory-safe), so there the wait comes after every chunk is queued (the GPU has work
            for the whole time the host waits); PyTorch indexes with the targets, so there it
            comes before the first chunk's math (after its logits GEMM is queued).

    Attributes: ``ce``, ``zl`` (N,) wide per-token terms; ``correct`` (N,) bool; ``pred`` (N,)
    int64, each token's argmax, with ``opts.return_predicted_tokens`` (else None).
    """

    def __init__(self, opts: LinearCrossEntropyOptions, V: int, t, cw, s_ce, s_z, like: torch.Tensor, check=None):
        N, wide = like.shape[0], wide_dtype(like)
        self.opts, self.V, self.t, self.cw, self.s_ce, self.s_z, self.check = opts, V, t, cw, s_ce, s_z, check
        self.kernel = triton_runs(like)
        # Σ w_c serves label smoothing only: a host sync, before the chunks, only when both are asked for
        self.w_sum = float(cw.sum()) if cw is not None and opts.label_smoothing > 0 else float(V)
        self.ce = torch.empty(N, dtype=wide, device=like.device)
        self.zl = torch.empty(N, dtype=wide, device=like.device)
        self.correct = torch.empty(N, dtype=torch.bool, device=like.device)
        self.pred = torch.empty(N, dtype=torch.int64, device=like.device) if opts.return_predicted_tokens else None

    def chunk(self, rows: slice, logits: torch.Tensor, bias: torch.Tensor | None, want_grad: bool):
        o = self.opts
        s_ce, s_z = (self.s_ce[rows], self.s_z[rows]) if self.s_ce.dim() == 1 else (self.s_ce, self.s_z)
        t, ce, zl, ok = self.t[rows], self.ce[rows], self.zl[rows], self.correct[rows]
        pred = None if self.pred is None else self.pred[rows]
        if self.kernel:
            return chunk_kernel(
                logits,
                t,
                self.cw,
                ce,
                zl,
                ok,
                s_ce,
                s_z,
                V=self.V,
                ignore_index=o.ignore_index,
                w_sum=self.w_sum,
                label_smoothing=o.label_smoothing,
                z_loss=o.z_loss,
                softcap=o.softcap,
                want_grad=want_grad,
                bias=bias,
                pred=pred,
            )
        self.finish()  # before the first chunk's math indexes with the targets
        z = logits.to(wide_dtype(logits))
        if bias is not None:
            z = z + bias.to(z.dtype)
        if o.softcap is not None:
            z = o.softcap * torch.tanh(z / o.softcap)
        c_ce, c_zl, c_ok, g = chunk_math(
            z,
            t,
            t != o.ignore_index,
            self.cw,
            V=self.V,
            W_sum=self.w_sum,
            label_smoothing=o.label_smoothing,
            z_loss=o.z_loss,
            softcap=o.softcap,
            s_ce=s_ce,
            s_z=s_z,
            want_grad=want_grad,
        )
        ce.copy_(c_ce), zl.copy_(c_zl), ok.copy_(c_ok)
        if pred is not None:
            pred.copy_(z.argmax(-1))  # torch.argmax: the first NaN, else the first maximum
        return None if g is None else g.to(logits.dtype)

    def finish(self) -> None:
        if self.check is not None:
            check, self.check = self.check, None
            check()


def chunk_math(z, t, valid, cw, *, V, W_sum, label_smoothing, z_loss, softcap, s_ce, s_z, want_grad: bool):
    """Per-token terms and, when ``want_grad``, the logits' gradient, for one chunk.

    Args:
        z: (C, V) fp32 logits after the softcap (``softcap``: its cap, or None).
        t, valid: (C,) targets and their non-ignored mask.
        cw: (V,) fp32 class weights or None; ``W_sum`` their sum (V without weights; read only
            with label smoothing).
        s_ce, s_z: scales of the cross-entropy and z-loss gradients (scalars or (C,) per token).

    Returns ``(ce, zl, correct, d_logits or None)``: the gradient is with respect to the logits
    before the softcap, scaled; on ignored rows the terms are 0 and the gradient is 0 (NaN where
    torch's is: a row whose log_softmax is NaN). Non-finite logits: as the module docstring says.

    Two (C, V) buffers in all, reused in place unless the call is recorded (``_triton.recorded``):
    on the CPU a fresh one costs its page faults (an out-of-place ``exp`` of 4096 x 8192 fp32 took
    210 ms against 23 ms in place on the 2-core CI box), and the (C, V) passes are this path's cost.
    """
    record = recorded(z)
    # torch.logsumexp's own steps (ATen's logsumexp_out_impl: a ±inf max counts as 0), with its
    # intermediates kept: lse has its bits and ±inf with a ±inf max, NaN with a NaN (the z-loss's)
    mx = z.amax(-1)
    mx = mx.masked_fill(mx.abs() == float("inf"), 0.0)
    y = z - mx[:, None]  # relative to the max, as log_softmax
    e = torch.exp(y)
    s = e.sum(-1)
    lse = s.log().add_(mx)
    # F.cross_entropy's log_softmax is NaN on a row whose max is ±inf (z − max = inf − inf): the
    # cross-entropy and its gradient use lse where finite, NaN elsewhere (where y is z or NaN:
    # every term below reads log_s, NaN there)
    finite = lse.isfinite()
    lse_ce = torch.where(finite, lse, torch.nan)
    # (max − z_t) + log S and p = e^((z − max) − log S); lse − z_t would cancel to ulp(lse) for a
    # confident token
    log_s = torch.where(finite, s.log(), torch.nan)
    # a target outside [0, V) reads class 0, as the kernel does: memory-safe where the caller's range
    # check is finished later (a patched HF model's, started before its decoder: targets_checked)
    t_safe = torch.where(valid & (t >= 0) & (t < V), t, 0)
    y_t = y.gather(1, t_safe[:, None]).squeeze(1)
    w_t = cw[t_safe] if cw is not None else torch.ones_like(lse)
    eps = float(label_smoothing)
    ce = w_t * (log_s - y_t)
    if eps > 0:
        wz = z @ cw if cw is not None else z.sum(-1)
        ce = (1 - eps) * ce + eps / V * (W_sum * lse_ce - wz)
    # selected, not multiplied by 0: an ignored row's inf / NaN logits must not reach the loss
    ce = torch.where(valid, ce, 0.0)
    zl = torch.where(valid, z_loss * lse.square(), 0.0)
    correct = (z.argmax(-1) == t) & valid
    if not want_grad:
        return ce, zl, correct, None
    # in e's buffer: the same bits as exp(y − log S)
    p = torch.exp(y - log_s[:, None]) if record else torch.sub(y, log_s[:, None], out=e).exp_()
    a = ((1 - eps) * w_t)[:, None]
    g = p * a if record or eps > 0 or z_loss else p.mul_(a)  # p is read again below only with those
    g.scatter_add_(1, t_safe[:, None], -a)
    if eps > 0:
        g += eps / V * (p * W_sum - (cw[None, :] if cw is not None else 1.0))
    # s_ce, s_z: 0-dim (a reduction's scale) or (C,) (per-token upstream). An ignored row's are 0,
    # whatever the upstream (inf or NaN included): its d_logits are 0·p, as torch's log_softmax
    # backward gives (0 − exp(out)·0): 0, or NaN on a row whose log_softmax is NaN
    g *= torch.where(valid, s_ce, 0.0)[:, None]
    if z_loss:
        g += (2 * z_loss * lse_ce * torch.where(valid, s_z, 0.0))[:, None] * p
    if softcap is not None:
        q = z / softcap if record else torch.div(z, softcap, out=y)  # in y's buffer
        g *= 1 - q.square() if record else q.square_().neg_().add_(1)
    return ce, zl, correct, g


def chunk_kernel(
    logits,
    t,
    cw,
    ce,
    zl,
    ok,
    s_ce,
    s_z,
    *,
    V,
    ignore_index,
    w_sum,
    label_smoothing,
    z_loss,
    softcap,
    want_grad,
    bias=None,
    pred=None,
):
    """:func:`chunk_math` for one chunk in one Triton kernel (``kernels/linear_cross_entropy.py``), on CUDA
    or for fp32 under the CPU interpreter.

    Args:
        logits: (C, ≥ V) logits in the input dtype, rows of ``logits.stride(0)`` elements (padded
            rows allowed); d_logits are written over their first V columns when ``want_grad``.
        t: (C,) int64 targets. cw: (V,) fp32 class weights or None. ce, zl, ok: (C,) outputs
            (per-token cross-entropy and z-loss in fp32, argmax == target).
        s_ce, s_z: 0-dim or (C,) fp32 scales of the gradient, read on the device (no host sync).
        bias: (V,) added to the logits in fp32 by the kernel, or None (the GEMM added it).
        pred: (C,) int64, the argmax of each row written there, or None.

    Returns the d_logits (the ``logits`` tensor) when ``want_grad``, else None.
    """
    if logits.shape[0] == 0:
        return None
    launch(
        lce_chunk_op,
        logits,
        t,
        cw,
        ce,
        zl,
        ok,
        s_ce,
        s_z,
        bias,
        V,
        ignore_index,
        float(w_sum),
        float(label_smoothing),
        float(z_loss),
        None if softcap is None else float(softcap),
        want_grad,
        pred,
    )
    return logits if want_grad else None


@custom_op("truefuse::lce_chunk", mutates_args=("logits", "ce", "zl", "ok", "pred"))
def lce_chunk_op(
    logits: torch.Tensor,
    t: torch.Tensor,
    cw: torch.Tensor | None,
    ce: torch.Tensor,
    zl: torch.Tensor,
    ok: torch.Tensor,
    s_ce: torch.Tensor,
    s_z: torch.Tensor,
    bias: torch.Tensor | None,
    V: int,
    ignore_index: int,
    w_sum: float,
    label_smoothing: float,
    z_loss: float,
    softcap: float | None,
    want_grad: bool,
    pred: torch.Tensor | None,  # no default: torch 2.11's dispatcher drops a trailing argument equal to its
    # default before the mutation bookkeeping indexes it (IndexError under torch.compile, H100)
) -> None:
    """The kernel launch of :func:`chunk_kernel` as a custom op (docs/design.md §6.7): writes
    ``ce``, ``zl``, ``ok``, ``pred`` (when given) and, when ``want_grad``, the d_logits over ``logits``."""
    from truefuse.kernels.linear_cross_entropy import _linear_cross_entropy_chunk_kernel

    C = logits.shape[0]
    if C == 0:
        return
    _linear_cross_entropy_chunk_kernel[(C,)](
        logits,
        logits.stride(0),
        bias if bias is not None else logits,
        t,
        cw if cw is not None else ce,
        ce,
        zl,
        ok,
        pred if pred is not None else ok,
        s_ce.contiguous(),
        s_z.contiguous(),
        V,
        ignore_index,
        w_sum,
        label_smoothing,
        z_loss,
        softcap or 1.0,
        HAS_BIAS=bias is not None,
        HAS_CW=cw is not None,
        SMOOTH=label_smoothing > 0,
        SOFTCAP=softcap is not None,
        WANT_GRAD=want_grad,
        PER_TOKEN=s_ce.dim() == 1,
        BLOCK_V=2048 if logits.is_cuda else 64,
        num_warps=8,  # 8 logits a thread: fastest at every V (H200)
        WANT_PRED=pred is not None,
    )


@lce_chunk_op.register_fake
def _(logits, t, cw, ce, zl, ok, s_ce, s_z, bias, V, ignore_index, w_sum, label_smoothing, z_loss, softcap, want_grad, pred):
    return None
