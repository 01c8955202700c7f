"""Contract cases of ``truefuse.attention`` (docs/attention.md).

bounded: forward, dq, dk, dv against ``attention_ref`` in float64, the same-dtype SDPA as the
baseline (the reference in the input dtype for softcap and windows, which SDPA lacks).
bitwise: a sequence's rows alone equal its rows in a left- and a right-padded batch; decode steps
(one query, then a chunk of three) equal one causal prefill; two backward runs are equal.
On CUDA the shapes are larger (head dim 128, sequences across several of the kernels' chunks).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from truefuse.autograd.attention import attention
from truefuse.ops.attention.attention import attention_ref
from truefuse.testing import bitwise_report, fwd_bwd_reports
from truefuse.verify.registry import register

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _shape(device):
    """(B, Hq, Hk, L, D): tiny under the CPU interpreter; on a GPU several key chunks (512 keys),
    and decode's 12 query programs split them (ops/attention/attention.py)."""
    return (3, 4, 2, 1100, 128) if device.type == "cuda" else (2, 2, 1, 18, 16)


def _qkv(B, Hq, Hk, L, D, device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, h, L, D, generator=g).to(device, dtype) for h in (Hq, Hk, Hk))


def _pad_mask(lengths, L, left, device):
    """(B, 1, 1, L) bool key mask of sequences of ``lengths``, left- or right-padded to L."""
    cols = torch.arange(L)
    return torch.stack([(cols >= L - n) if left else (cols < n) for n in lengths])[:, None, None].to(device)


def _ref_on_cpu(q, k, v, attn_mask=None, **kw):
    """``attention_ref`` on the float64 CPU copies, the mask brought to them."""
    return attention_ref(q, k, v, None if attn_mask is None else attn_mask.to(q.device), **kw)


def _bounded(dtype, variant):
    def case(device):
        B, Hq, Hk, L, D = _shape(device)
        q, k, v = _qkv(B, Hq, Hk, L, D, device, dtype)
        if variant == "causal_gqa_padded":
            # right padding: every query row sees a key (SDPA gives NaN on a row that sees none)
            lengths = [L] + [L * 2 // 3] * (B - 1)
            mask = _pad_mask(lengths, L, False, device) & torch.ones(L, L, dtype=torch.bool, device=device).tril()
            kw, base = dict(attn_mask=mask, enable_gqa=True), F.scaled_dot_product_attention
        else:
            kw, base = dict(is_causal=True, enable_gqa=True, softcap=5.0, window=L // 3), attention_ref
        return fwd_bwd_reports(attention, _ref_on_cpu, base, {"q": q, "k": k, "v": v}, **kw)

    return case


def _batch_invariant(dtype):
    def case(device):
        B, Hq, Hk, L, D = _shape(device)
        q, k, v = _qkv(B + 1, Hq, Hk, L, D, device, dtype, seed=1)
        lengths = [L, L // 2, L - 5, 7][: B + 1]
        causal = torch.ones(L, L, dtype=torch.bool, device=device).tril()
        # each sequence alone is its first n tokens; the right-padded batch holds them at 0..n-1,
        # the left-padded one (rolled) at L-n..L-1: one alone run serves both
        alone = [None] * len(lengths)
        reps = {}
        for left in (True, False):
            qkv = [torch.stack([t[b].roll(L - n, 1) if left else t[b] for b, n in enumerate(lengths)]) for t in (q, k, v)]
            out = attention(*qkv, attn_mask=_pad_mask(lengths, L, left, device) & causal, enable_gqa=True)
            for b, n in enumerate(lengths):
                if alone[b] is None:
                    alone[b] = attention(
                        q[b : b + 1, :, :n], k[b : b + 1, :, :n], v[b : b + 1, :, :n], is_causal=True, enable_gqa=True
                    )
                sl = slice(L - n, L) if left else slice(0, n)
                reps[f"{'left' if left else 'right'}_seq{b}_len{n}"] = bitwise_report(out[b : b + 1, :, sl], alone[b])
        return reps

    return case


def _decode_vs_prefill(dtype):
    def case(device):
        B, Hq, Hk, L, D = _shape(device)
        q, k, v = _qkv(B, Hq, Hk, L, D, device, dtype, seed=2)
        prefill = attention(q, k, v, is_causal=True, enable_gqa=True)
        reps = {}
        for t in (0, L // 2, L - 1):  # one new query against a cache of t + 1 keys
            step = attention(q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1], enable_gqa=True)
            reps[f"step{t}"] = bitwise_report(step, prefill[:, :, t : t + 1])
        t0 = L - 4  # a chunk of 3 new queries, causal by a (bottom-right) mask
        mask = torch.ones(3, t0 + 3, dtype=torch.bool, device=device).tril(t0)
        chunk = attention(q[:, :, t0 : t0 + 3], k[:, :, : t0 + 3], v[:, :, : t0 + 3], attn_mask=mask, enable_gqa=True)
        reps["chunk3"] = bitwise_report(chunk, prefill[:, :, t0 : t0 + 3])
        return reps

    return case


def _backward_deterministic(dtype):
    def case(device):
        B, Hq, Hk, L, D = _shape(device)
        q, k, v = _qkv(1, Hq, Hk, L, D, device, dtype, seed=3)
        grads = []
        for _ in range(2):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = attention(*leaves, is_causal=True, enable_gqa=True)
            out.backward(torch.ones_like(out))
            grads.append([t.grad for t in leaves])
        return {f"d{n}": bitwise_report(a, b) for n, a, b in zip("qkv", *grads, strict=True)}

    return case


for _dn, _dt in _DTYPES.items():
    register("attention", f"causal_gqa_padded_{_dn}", "bounded")(_bounded(_dt, "causal_gqa_padded"))
for _dn in ("fp32", "bf16"):
    _dt = _DTYPES[_dn]
    register("attention", f"softcap_window_{_dn}", "bounded")(_bounded(_dt, "softcap_window"))
    register("attention", f"batch_invariant_{_dn}", "bitwise")(_batch_invariant(_dt))
    register("attention", f"decode_vs_prefill_{_dn}", "bitwise")(_decode_vs_prefill(_dt))
    register("attention", f"backward_deterministic_{_dn}", "bitwise")(_backward_deterministic(_dt))
