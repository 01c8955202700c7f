"""``python -m truefuse bench attention``: ``truefuse.attention`` against
``scaled_dot_product_attention`` on its flash backend, bf16, in one run (docs/benchmarks.md,
"Attention").

Points (issue 33): causal training shapes, B=4, 32 query / 8 key-value heads, D=128, L 2048 and
4096, forward (``fwd``) and forward + backward (``fwd_bwd``); decode (``decode``): one new query
per sequence against L cached keys, batch 1, 8, 32, L 2k and 8k. Goals: forward ≥ 0.8× SDPA's
speed, backward ≥ 0.7×, decode latency ≤ 1.3× SDPA's. Timed under CUDA graphs (decode is a
~10-100 µs call: without graphs the host is measured).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from truefuse.autograd.attention import attention
from truefuse.bench.harness import Sweep

CUDA_GRAPH = True
_BF = torch.bfloat16
_HQ, _HK, _D = 32, 8, 128


def _inputs(p, device):
    g = torch.Generator(device=device).manual_seed(0)
    Lq = 1 if p["mode"] == "decode" else p["L"]
    q = torch.randn(p["B"], _HQ, Lq, _D, generator=g, device=device, dtype=_BF)
    k, v = (torch.randn(p["B"], _HK, p["L"], _D, generator=g, device=device, dtype=_BF) for _ in range(2))
    return q, k, v


def _flash(q, k, v, is_causal):
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)


def _provider(which):
    def make(p, device):
        q, k, v = _inputs(p, device)
        causal = p["mode"] != "decode"
        if which == "sdpa_flash":
            # flash takes no enable_gqa on every torch: the heads repeated outside the timing
            k, v = (t.repeat_interleave(_HQ // _HK, 1) for t in (k, v))

            def fwd(q, k, v):
                return _flash(q, k, v, causal)
        else:

            def fwd(q, k, v):
                return attention(q, k, v, is_causal=causal, enable_gqa=True)

        if p["mode"] != "fwd_bwd":
            return lambda: fwd(q, k, v)
        leaves = [t.requires_grad_() for t in (q, k, v)]
        dy = torch.randn_like(q)
        return lambda: torch.autograd.grad(fwd(*leaves), leaves, dy)

    return make


def _flops(p) -> float:
    if p["mode"] == "decode":
        return 0.0
    fwd = 4.0 * p["B"] * _HQ * p["L"] * p["L"] * _D / 2  # causal: half the scores
    return fwd * (3.5 if p["mode"] == "fwd_bwd" else 1.0)  # backward: 2.5 forward's matmuls


def _bytes(p) -> float:
    return 2.0 * 2 * p["B"] * _HK * p["L"] * _D if p["mode"] == "decode" else 0.0  # the cache read once


def sweep(quick: bool) -> Sweep:
    if quick:
        points = [{"mode": m, "B": 1, "L": 256} for m in ("fwd", "fwd_bwd", "decode")]
    else:
        points = [{"mode": m, "B": 4, "L": n} for m in ("fwd", "fwd_bwd") for n in (2048, 4096)]
        points += [{"mode": "decode", "B": b, "L": n} for n in (2048, 8192) for b in (1, 8, 32)]
    return Sweep(
        name="attention",
        points=points,
        providers={"sdpa_flash": _provider("sdpa_flash"), "truefuse": _provider("truefuse")},
        reference="sdpa_flash",
        x="L",
        flops=_flops,
        bytes=_bytes,
    )
