"""Per-token log-probabilities and entropy from given logits: the reference and the per-row pass.

What an RL sampler computes from the logits it sampled from (``model.generate``'s scores, or a
forward's ``.logits``): ``u = logits / temperature``, ``log_prob = log_softmax(u)[target]``,
``entropy = logsumexp(u) − Σ softmax(u)·u``, fp32 (fp64 on fp64 logits), 0 where the target is
``ignore_index`` (``token_log_probs_ref``; ``linear_log_probs``' semantics without the GEMM and the
softcap). The pass runs ``linear_log_probs``' own per-chunk math (``LogProbChunks``: its Triton
kernel, one program per row, on CUDA and for fp32 under the CPU interpreter; else ``chunk_math``
in PyTorch) over the logits as given, so for the same logits the two ops give the same bits
(docs/design.md §1, batch invariance: the trainer's ``model_log_probs`` and the sampler's
``token_log_probs`` agree), and a row's result never depends on the other rows: every launch
parameter comes from V. No new kernel: the head's earns its keep here unchanged.
"""

from __future__ import annotations

import torch

from truefuse.ops._launch.dtypes import wide_dtype
from truefuse.ops.lm_head.chunked_head import invariant_chunk
from truefuse.ops.lm_head.linear_log_probs import LinearLogProbsOptions, LinearLogProbsOutput, LogProbChunks, _from_logits

#: What ``token_log_probs``, ``linear_log_probs`` and ``model_log_probs`` return: ``(log_probs, entropy)``.
LogProbs = LinearLogProbsOutput


def token_log_probs_ref(
    logits: torch.Tensor, target: torch.Tensor, *, temperature: float = 1.0, ignore_index: int = -100
) -> LinearLogProbsOutput:
    """The unfused composition in plain PyTorch, fp32 math (fp64 on fp64 logits): ``log_softmax``,
    ``gather``, ``logsumexp``, ``softmax``. ``logits`` (..., V), ``target`` (...)."""
    z = logits.reshape(-1, logits.shape[-1]).to(wide_dtype(logits))
    return _from_logits(z, target, temperature=temperature, softcap=None, ignore_index=ignore_index)


def token_log_probs_plain(logits, target, *, temperature=1.0, ignore_index=-100):
    """What a user writes without us, in the logits' dtype up to the division (the bounded
    contract's same-dtype baseline): ``(logits / temperature).float()``, then the reference's math."""
    z = (logits / temperature).reshape(-1, logits.shape[-1]).to(wide_dtype(logits))
    return _from_logits(z, target, temperature=1.0, softcap=None, ignore_index=ignore_index)


def token_log_probs_rows(
    logits: torch.Tensor,
    t: torch.Tensor,
    opts: LinearLogProbsOptions,
    a: torch.Tensor | None = None,
    c: torch.Tensor | None = None,
    check=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(log_probs, entropy, d_logits or None)`` of ``logits`` (N, V), row-contiguous, against
    ``t`` (N,) int64. With ``a``, ``c`` (N,) wide upstream gradients, d_logits (N, V) in the
    logits' dtype; the Triton kernel writes them over ``logits`` (pass a copy). Rows go in blocks
    of ``invariant_chunk(V)`` (a function of V and the dtype: the PyTorch math's fp32 temporaries
    stay within ``chunk_bytes``). ``check``: ``check_targets``' finish, called once."""
    N, V = logits.shape
    want = a is not None
    pass_ = LogProbChunks(opts, V, t, a, c, like=logits, check=check)
    d = torch.empty_like(logits) if want and not pass_.kernel else None
    step = invariant_chunk(V, 0, 4, False)
    for start in range(0, N, step):
        rows = slice(start, min(start + step, N))
        g = pass_.chunk(rows, logits[rows], None, want)
        if d is not None:
            d[rows] = g
    pass_.finish()
    return pass_.log_probs, pass_.entropy, (logits if pass_.kernel else d) if want else None
