"""Contract cases of ``token_log_probs`` (docs/design.md §1): log-probs, entropies and the logits'
gradient under random per-token upstream gradients against the float64 reference (bounded, the
baseline ``token_log_probs_plain``), on top-k-masked (−inf) logits too; and, bitwise, the values
``linear_log_probs`` gives for the same logits (its one chunk's GEMM, ``truefuse.gemm``, run here
to make them): the sampler's and the trainer's log-probs agree."""

from __future__ import annotations

import torch

from truefuse.autograd.linear_log_probs import linear_log_probs
from truefuse.autograd.token_log_probs import token_log_probs
from truefuse.ops.gemm.gemm import gemm
from truefuse.ops.lm_head.token_log_probs import token_log_probs_plain, token_log_probs_ref
from truefuse.testing import bitwise_report, bounded_report
from truefuse.verify.cases_linear_cross_entropy import make_inputs
from truefuse.verify.registry import register


def run_token_log_probs(fn, logits, t, *, upstream, **kw):
    """Outputs and the logits' gradient of ``fn`` (the op, its reference or the plain path)."""
    z = logits.detach().clone().requires_grad_()
    out = fn(z, t.to(z.device), **kw)
    a, c = (u.to(z.device, out.log_probs.dtype) for u in upstream)
    (dz,) = torch.autograd.grad((out.log_probs * a + out.entropy * c).sum(), [z])
    return {"log_probs": out.log_probs.detach(), "entropy": out.entropy.detach(), "dlogits": dz}


def _logits(dtype, device):
    x, W, t, _ = make_inputs(dtype, device, lead=(2,), N=9)  # (2, 9) tokens, 203 classes
    return gemm(x.reshape(-1, x.shape[-1]), W.t()).view(2, 9, -1), t, x, W


def mask_top_k(z, t, k=20):
    """Sampler scores: every logit but each row's top ``k`` set to −inf (top-k), and each kept
    target outside them moved to its row's largest (a sampler never draws a masked token; the
    bounded check's relative error needs finite references)."""
    keep = torch.zeros_like(z, dtype=torch.bool).scatter_(-1, z.topk(k, dim=-1).indices, True)
    masked = z.masked_fill(~keep, float("-inf"))
    drawn = keep.gather(-1, t.clamp(min=0)[..., None]).squeeze(-1)
    return masked, torch.where((t < 0) | drawn, t, z.argmax(-1))


def _bounded(dtype, temperature, masked=False):
    def case(device):
        z, t, _, _ = _logits(dtype, device)
        if masked:  # finite entropies (0·log 0 = 0) and gradients all the same
            z, t = mask_top_k(z, t)
        g = torch.Generator().manual_seed(7)
        up = (torch.randn(t.shape, generator=g, dtype=torch.float64), torch.randn(t.shape, generator=g, dtype=torch.float64))
        got = run_token_log_probs(token_log_probs, z, t, upstream=up, temperature=temperature)
        base = run_token_log_probs(token_log_probs_plain, z, t, upstream=up, temperature=temperature)
        ref = run_token_log_probs(token_log_probs_ref, z.cpu().double(), t.cpu(), upstream=up, temperature=temperature)
        return {k: bounded_report(got[k], ref[k], base[k]) for k in got}

    return case


def _same_as_linear_log_probs(dtype):
    def case(device):
        z, t, x, W = _logits(dtype, device)
        mine = token_log_probs(z, t, temperature=0.7)
        head = linear_log_probs(x, W, t, temperature=0.7, chunk_size=x.shape[0] * x.shape[1])
        return {k: bitwise_report(getattr(mine, k), getattr(head, k)) for k in ("log_probs", "entropy")}

    return case


for _dn, _dt in {"bf16": torch.bfloat16, "fp32": torch.float32}.items():
    register("token_log_probs", f"plain_{_dn}", "bounded")(_bounded(_dt, 1.0))
    register("token_log_probs", f"temperature_{_dn}", "bounded")(_bounded(_dt, 0.7))
    register("token_log_probs", f"same_as_linear_log_probs_{_dn}", "bitwise")(_same_as_linear_log_probs(_dt))
    register("token_log_probs", f"masked_top_k_{_dn}", "bounded")(_bounded(_dt, 0.7, masked=True))
