"""Which tiles of ``ops/attention_config.py`` are fastest for bf16, head dim 128 (issue 33)?

Times the forward, forward + backward (B=4, 32/8 heads, causal, L=4096) and decode (B=1 and 32,
8192 cached keys) for candidate tiles against SDPA's flash backend, by replacing
``truefuse.ops.attention.attention_config`` for each. Prints one row per candidate (ms).
Run: ``PYTHONPATH=. python experiments/exp_attention_configs.py`` on one GPU.
"""

import torch
import torch.nn.functional as F
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

import truefuse.ops.attention as ops_attention
from truefuse.autograd.attention import attention
from truefuse.ops.attention_config import AttentionConfig

FWD = [(64, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 3), (64, 64, 4, 4)]
BWD = [(32, 64, 64, 32, 4, 3), (64, 64, 64, 64, 8, 2), (32, 64, 64, 32, 4, 2), (32, 64, 64, 32, 2, 3)]


def _t(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main():
    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*s):
        return torch.randn(*s, generator=g, device=dev, dtype=bf)

    q, k, v = rnd(4, 32, 4096, 128), rnd(4, 8, 4096, 128), rnd(4, 8, 4096, 128)
    kr, vr = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
    dy = torch.randn_like(q)
    dec = {b: (rnd(b, 32, 1, 128), rnd(b, 8, 8192, 128), rnd(b, 8, 8192, 128)) for b in (1, 32)}
    ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
    qr, krl, vrl = (t.clone().requires_grad_() for t in (q, kr, vr))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        sf = _t(lambda: F.scaled_dot_product_attention(q, kr, vr, is_causal=True))
        sb = _t(lambda: torch.autograd.grad(F.scaled_dot_product_attention(qr, krl, vrl, is_causal=True), (qr, krl, vrl), dy))
        sd = {
            b: _t(lambda b=b: F.scaled_dot_product_attention(dec[b][0], *(t.repeat_interleave(4, 1) for t in dec[b][1:])))
            for b in dec
        }
    print(f"sdpa_flash: fwd {sf:.3f} fwd_bwd {sb:.3f} decode1 {sd[1]:.4f} decode32 {sd[32]:.4f} (decode incl. repeat)")
    for f in FWD:
        for bw in BWD if f == FWD[0] else BWD[:1]:
            cfg = AttentionConfig(*f, *bw, 512)
            ops_attention.attention_config = lambda *a, cfg=cfg: cfg
            try:
                tf = _t(lambda: attention(q, k, v, is_causal=True, enable_gqa=True))
                tb = _t(lambda: torch.autograd.grad(attention(ql, kl, vl, is_causal=True, enable_gqa=True), (ql, kl, vl), dy))
                td = {b: _t(lambda b=b: attention(*dec[b], enable_gqa=True)) for b in dec}
                print(
                    f"{f} {bw}: fwd {tf:.3f} ({sf / tf:.2f}x) fwd_bwd {tb:.3f} ({sb / tb:.2f}x) "
                    f"decode1 {td[1]:.4f} ({td[1] / sd[1]:.2f}x lat) decode32 {td[32]:.4f} ({td[32] / sd[32]:.2f}x lat)"
                )
            except Exception as e:  # a tile that does not fit shared memory
                print(f"{f} {bw}: {type(e).__name__}: {str(e)[:120]}")


if __name__ == "__main__":
    main()
