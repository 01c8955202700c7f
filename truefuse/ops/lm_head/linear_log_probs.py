"""Linear log-probabilities and entropy: the reference, the options, and the per-chunk math over
the chunked LM head (``ops/lm_head/chunked_head.py``), the second loss on it after the cross-entropy.

What RL trainers (GRPO, PPO) compute from the LM head for each token: the log-probability of the
token taken and the entropy of the distribution it was drawn from. Semantics
(``linear_log_probs_ref``): ``logits = F.linear(input, W, b)`` in fp32, then
``softcap * tanh(logits / softcap)``, then ``u = logits / temperature``;
``log_prob = log_softmax(u)[target]`` and ``entropy = logsumexp(u) − Σ softmax(u)·u`` (the
expression trainers use). Both per token, shaped like ``target``, fp32 (fp64 on fp64 inputs).
A target equal to ``ignore_index`` gives 0 for both, selected (``torch.where``), never multiplied
by 0, and no gradient from them.

Non-finite logits: what those expressions give in torch: a NaN or +inf logit makes the token's
log-prob and entropy NaN. A −inf logit (a top-k / top-p masked score) has probability 0 and, as in
``torch.distributions.Categorical``'s entropy, adds 0·log 0 = 0 to it: finite outputs (a −inf
target's log-prob is −inf) and gradients, 0 at the −inf logits but a −inf target's (its upstream:
``log_softmax``'s). A row of −inf is NaN, as ``log_softmax`` gives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from truefuse.ops._launch.custom_op import custom_op, launch
from truefuse.ops._launch.dtypes import wide_dtype
from truefuse.ops._launch.triton import recorded, triton_runs


class LinearLogProbsOutput(NamedTuple):
    """What ``linear_log_probs`` returns, each shaped like ``target``, fp32 (fp64 on fp64 inputs).

    Attributes:
        log_probs: log-probability of each token's target (0 where ignored).
        entropy: entropy of each token's distribution (0 where ignored).
    """

    log_probs: torch.Tensor
    entropy: torch.Tensor


@dataclass(frozen=True)
class LinearLogProbsOptions:
    """The options, held once and checked when built (``ValueError`` naming the option).

    Attributes:
        temperature: > 0, finite: the logits are divided by it (after the softcap).
        softcap: > 0, finite, or None. ignore_index: targets equal to it give 0 and no gradient.
        chunk_size: tokens per chunk, or None (``chunked_head.default_chunk``).
        fp32_weight_grad: accumulate the weight gradient across chunks in fp32 (round once).
    """

    temperature: float = 1.0
    softcap: float | None = None
    ignore_index: int = -100
    chunk_size: int | None = None
    fp32_weight_grad: bool = True

    def __post_init__(self):
        if not 0.0 < float(self.temperature) < math.inf:
            raise ValueError(f"temperature must be positive and finite, got {self.temperature}")
        if self.softcap is not None and not 0.0 < float(self.softcap) < math.inf:
            raise ValueError(f"softcap must be positive and finite, or None, got {self.softcap}")
        chunk = self.chunk_size
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"chunk_size must be a positive int or None, got {chunk!r}")
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "ignore_index", int(self.ignore_index))
        object.__setattr__(self, "fp32_weight_grad", bool(self.fp32_weight_grad))
        if self.softcap is not None:
            object.__setattr__(self, "softcap", float(self.softcap))


def _from_logits(logits, target, *, temperature, softcap, ignore_index) -> LinearLogProbsOutput:
    t = target.reshape(-1)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    u = logits / temperature
    valid = t != ignore_index
    logp = torch.log_softmax(u, dim=-1).gather(1, torch.where(valid, t, 0)[:, None]).squeeze(1)
    # 0·log 0 = 0, as torch.distributions.Categorical's entropy: a −inf logit (masked) adds 0 to
    # Σ softmax·u and gets no gradient from it (not 0·(−inf) = NaN, which would reach the log-probs'
    # gradient too). Selected, not clamped as Categorical does: the product's gradient in p would
    # be upstream · finfo.min, −inf past an upstream of 1 (NaN through softmax's backward).
    u_finite = torch.where(u == -torch.inf, 0.0, u)
    entropy = torch.logsumexp(u, dim=-1) - (torch.softmax(u, dim=-1) * u_finite).sum(-1)
    zero = torch.zeros((), dtype=u.dtype, device=u.device)
    logp, entropy = torch.where(valid, logp, zero), torch.where(valid, entropy, zero)
    return LinearLogProbsOutput(logp.view(target.shape), entropy.view(target.shape))


def linear_log_probs_ref(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    linear_bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    chunk_size: int | None = None,
) -> LinearLogProbsOutput:
    """The unfused composition in plain PyTorch, fp32 math (fp64 on fp64 inputs): the semantics
    ``truefuse.linear_log_probs`` must match. Materializes the (tokens, V) logits.
    ``chunk_size`` is accepted and ignored."""
    wide = wide_dtype(input)
    x = input.reshape(-1, input.shape[-1]).to(wide)
    logits = F.linear(x, linear_weight.to(wide), None if linear_bias is None else linear_bias.to(wide))
    return _from_logits(logits, target, temperature=temperature, softcap=softcap, ignore_index=ignore_index)


def linear_log_probs_plain(
    input, linear_weight, target, *, linear_bias=None, temperature=1.0, softcap=None, ignore_index=-100, **_
):
    """What a user writes without us: ``F.linear`` in the input's dtype, the rest in fp32 (the
    bounded contract's same-dtype baseline)."""
    logits = F.linear(input.reshape(-1, input.shape[-1]), linear_weight, linear_bias).to(wide_dtype(input))
    return _from_logits(logits, target, temperature=temperature, softcap=softcap, ignore_index=ignore_index)


def chunk_math(z, t, valid, a, c, *, temperature, softcap, want_grad: bool):
    """Per-token log-prob and entropy and, when ``want_grad``, the logits' gradient, for one chunk.

    Args:
        z: (C, V) wide logits after the softcap (``softcap``: its cap, or None).
        t, valid: (C,) targets and their non-ignored mask.
        a, c: (C,) upstream gradients of the log-probs and entropies (read when ``want_grad``).

    Returns ``(log_probs, entropy, d_logits or None)``; d_logits are with respect to the logits
    before the softcap: ``[a·(δ_t − p) − c·p·(log p + entropy)] / temperature`` times the
    softcap's derivative.
    """
    # four (C, V) buffers, a dead one reused in place unless the call is recorded (each fresh one
    # costs its page faults on the CPU: linear_cross_entropy_chunk.chunk_math); the same operations
    # either way, so the same bits
    record = recorded(z)
    u = z / temperature
    m = u.amax(-1, keepdim=True)
    shift = torch.where(m.isfinite(), m, 0.0)
    y = u - shift if record else u.sub_(shift)
    t_safe = torch.where(valid, t, 0)
    y_t = y.gather(1, t_safe[:, None]).squeeze(1)  # before the clamp: a −inf target's log-prob is −inf
    # 0·log 0 = 0 (Categorical's entropy): a −inf logit (a top-k / top-p masked score) held at the
    # lowest finite value, whose exp is 0 all the same, adds 0 to Σ p·y and to the gradient instead
    # of 0·(−inf) = NaN; NaN and +inf stay as they are
    lo = torch.finfo(y.dtype).min
    y = y.clamp(min=lo) if record else y.clamp_(min=lo)
    # relative to the max, as torch's log_softmax: y − log S, no cancellation against |max|; NaN
    # on the whole row when its max is not finite or a logit is NaN (as log_softmax gives)
    e = torch.exp(y)
    log_s = torch.log(e.sum(-1))
    log_s = torch.where((log_s + m.squeeze(1)).isfinite(), log_s, torch.nan)
    lp_all = y - log_s[:, None] if record else torch.sub(y, log_s[:, None], out=e)
    p = torch.exp(lp_all)
    py = p * y
    ent = log_s - py.sum(-1)
    lp = y_t - log_s
    out_lp, out_ent = torch.where(valid, lp, 0.0), torch.where(valid, ent, 0.0)
    if not want_grad:
        return out_lp, out_ent, None
    a, c = torch.where(valid, a, 0.0)[:, None], torch.where(valid, c, 0.0)[:, None]
    if record:
        g = -a * p - c * p * (lp_all + ent[:, None])
    else:  # the same products and sums, each rounded as above (c·p read before p is overwritten)
        cp_lp = torch.mul(c, p, out=py).mul_(lp_all.add_(ent[:, None]))
        g = torch.mul(-a, p, out=p).sub_(cp_lp)
    g.scatter_add_(1, t_safe[:, None], a)
    g /= temperature
    if softcap is not None:
        q = z / softcap if record else torch.div(z, softcap, out=y)  # in y's buffer
        g *= 1 - q.square() if record else q.square_().neg_().add_(1)
    return out_lp, out_ent, g


class LogProbChunks:
    """One pass of the log-probs and entropy over the chunks of N tokens (a ``ChunkLoss``).

    Args:
        opts: the options. V: classes. t: (N,) int64 targets.
        a, c: (N,) wide upstream gradients of the log-probs and entropies (None without gradients).
        like: the input (N, H): its device and dtype pick the Triton kernel (CUDA; fp32 under the
            CPU interpreter) or the same math in PyTorch (``chunk_math``).
        check: ``check_targets``' finish, called once (as ``CrossEntropyChunks`` does).

    Attributes: ``log_probs``, ``entropy``: (N,) wide.
    """

    def __init__(self, opts: LinearLogProbsOptions, V: int, t, a, c, like: torch.Tensor, check=None):
        N, wide = like.shape[0], wide_dtype(like)
        self.opts, self.V, self.t, self.a, self.c, self.check = opts, V, t, a, c, check
        self.kernel = triton_runs(like)
        self.log_probs = torch.empty(N, dtype=wide, device=like.device)
        self.entropy = torch.empty(N, dtype=wide, device=like.device)

    def chunk(self, rows: slice, logits: torch.Tensor, bias: torch.Tensor | None, want_grad: bool):
        o = self.opts
        t, lp, ent = self.t[rows], self.log_probs[rows], self.entropy[rows]
        a = None if self.a is None else self.a[rows]
        c = None if self.c is None else self.c[rows]
        if self.kernel:
            if logits.shape[0] == 0:
                return None
            launch(
                log_probs_chunk_op,
                logits,
                t,
                lp,
                ent,
                a if want_grad else None,
                c if want_grad else None,
                bias,
                self.V,
                o.ignore_index,
                o.temperature,
                o.softcap,
                want_grad,
            )
            return logits if want_grad else None
        self.finish()  # before the first chunk's math indexes with the targets
        z = logits.to(wide_dtype(logits))
        if bias is not None:
            z = z + bias.to(z.dtype)
        if o.softcap is not None:
            z = o.softcap * torch.tanh(z / o.softcap)
        c_lp, c_ent, g = chunk_math(
            z, t, t != o.ignore_index, a, c, temperature=o.temperature, softcap=o.softcap, want_grad=want_grad
        )
        lp.copy_(c_lp), ent.copy_(c_ent)
        return None if g is None else g.to(logits.dtype)

    def finish(self) -> None:
        if self.check is not None:
            check, self.check = self.check, None
            check()


@custom_op("truefuse::log_probs_chunk", mutates_args=("logits", "lp", "ent"))
def log_probs_chunk_op(
    logits: torch.Tensor,
    t: torch.Tensor,
    lp: torch.Tensor,
    ent: torch.Tensor,
    a: torch.Tensor | None,
    c: torch.Tensor | None,
    bias: torch.Tensor | None,
    V: int,
    ignore_index: int,
    temperature: float,
    softcap: float | None,
    want_grad: bool,
) -> None:
    """The chunk's Triton kernel as a custom op (docs/design.md §6.7): writes ``lp``, ``ent`` and,
    when ``want_grad``, the d_logits over ``logits`` (C, ≥ V rows of ``logits.stride(0)``)."""
    from truefuse.kernels.linear_log_probs import _linear_log_probs_chunk_kernel

    C = logits.shape[0]
    if C == 0:
        return
    _linear_log_probs_chunk_kernel[(C,)](
        logits,
        logits.stride(0),
        bias if bias is not None else logits,
        t,
        lp,
        ent,
        a.contiguous() if a is not None else lp,
        c.contiguous() if c is not None else lp,
        V,
        ignore_index,
        temperature,
        softcap or 1.0,
        HAS_BIAS=bias is not None,
        SOFTCAP=softcap is not None,
        WANT_GRAD=want_grad,
        BLOCK_V=2048 if logits.is_cuda else 64,
        num_warps=8,
    )


@log_probs_chunk_op.register_fake
def _(logits, t, lp, ent, a, c, bias, V, ignore_index, temperature, softcap, want_grad):
    return None
