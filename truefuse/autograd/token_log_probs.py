"""``truefuse.token_log_probs``: each target's log-probability and each row's entropy from given
logits, differentiable in the logits (``ops/lm_head/token_log_probs.py``). The sampler's half of an RL
loop's log-probs, whose trainer half is ``linear_log_probs`` / ``model_log_probs``
(docs/batch_invariance.md)."""

from __future__ import annotations

import torch

from truefuse.autograd._double_backward import refuses_double_backward
from truefuse.ops._launch.dtensor import refuse_dtensor
from truefuse.ops._launch.dtypes import wide_dtype
from truefuse.ops.lm_head.linear_cross_entropy import target_prologue
from truefuse.ops.lm_head.linear_log_probs import LinearLogProbsOptions, LinearLogProbsOutput
from truefuse.ops.lm_head.token_log_probs import token_log_probs_rows


class TokenLogProbsFunction(torch.autograd.Function):
    """Inputs: logits (N, V) row-contiguous, target (N,) int64, the options. Outputs: (N,) log-probs
    and (N,) entropies, wide. Backward runs the per-row pass again with both upstream gradients
    (on a copy of the logits: the kernel writes d_logits over its operand); it may run several
    times (``retain_graph``). Double backward is refused by name (``autograd/_double_backward.py``)."""

    @staticmethod
    def forward(ctx, logits, t, opts: LinearLogProbsOptions):
        check = target_prologue(t, logits.shape[1], opts.ignore_index, "sum", None, logits)[3]
        lp, ent, _ = token_log_probs_rows(logits, t, opts, check=check)
        ctx.opts = opts
        ctx.save_for_backward(logits, t)
        return lp, ent

    @staticmethod
    @refuses_double_backward("token_log_probs", "truefuse.ops.lm_head.token_log_probs.token_log_probs_ref")
    def backward(ctx, g_lp, g_ent):
        logits, t = ctx.saved_tensors
        wide = wide_dtype(logits)
        a = torch.zeros(t.shape, dtype=wide, device=t.device) if g_lp is None else g_lp.to(wide)
        c = torch.zeros(t.shape, dtype=wide, device=t.device) if g_ent is None else g_ent.to(wide)
        d = token_log_probs_rows(logits.clone(), t, ctx.opts, a, c)[2]
        return d, None, None


def token_log_probs(
    logits: torch.Tensor, target: torch.Tensor, *, temperature: float = 1.0, ignore_index: int = -100
) -> LinearLogProbsOutput:
    """Log-probability of each target and entropy of each row under ``softmax(logits / temperature)``.

    Args:
        logits: (..., V) fp16 / bf16 / fp32 / fp64, e.g. ``model(ids).logits[:, :-1]``.
        target: (...) int64/int32 token ids in [0, V), or ``ignore_index`` (outputs 0, no gradient).
        temperature: > 0, finite: the sampling temperature.

    Returns:
        :class:`truefuse.LogProbs` ``(log_probs, entropy)`` shaped like ``target``, fp32 (fp64 on
        fp64 logits), differentiable in ``logits`` (the gradient in the logits' dtype). For the
        same logits, the bits of ``linear_log_probs``' per-chunk math (docs/design.md §1), each row
        independent of the others. −inf logits (top-k / top-p-masked scores) have probability 0
        and add 0·log 0 = 0 to the entropy (``Categorical``'s): finite entropy and gradients, 0
        at the masked logits. Semantics: ``truefuse.ops.lm_head.token_log_probs.token_log_probs_ref``.

    Raises:
        TypeError / ValueError naming the argument before anything runs; ``ValueError`` for a
        target outside [0, V) other than ``ignore_index``.
    """
    refuse_dtensor("token_log_probs", logits=logits, target=target)
    opts = LinearLogProbsOptions(temperature=temperature, ignore_index=ignore_index)
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if logits.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise TypeError(f"logits has dtype {logits.dtype}; expected a float dtype")
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"target must hold class indices (int64 or int32), got {target.dtype}")
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have a last (vocabulary) dimension of at least 1, got shape {tuple(logits.shape)}")
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"target has shape {tuple(target.shape)}; logits {tuple(logits.shape)} want {tuple(logits.shape[:-1])}")
    if target.device != logits.device:
        raise ValueError(f"target is on {target.device} but logits on {logits.device}")
    z = logits.reshape(-1, logits.shape[-1]).contiguous()
    lp, ent = TokenLogProbsFunction.apply(z, target.reshape(-1).to(torch.int64), opts)
    return LinearLogProbsOutput(lp.view(target.shape), ent.view(target.shape))
