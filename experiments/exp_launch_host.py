"""Host time of truefuse's eager ops on CUDA against the stock ops they replace, and of the Triton
launches inside them: ``JITFunction.run`` against a launch through the compiled kernel's handle
(issue 34's BI ``generate``, issue 35's small model under FSDP2: both host-bound on an H100).

Decode-sized bf16 inputs (4 sequences, hidden 2048, 16/8 heads of 64), so that the GPU is never the
bottleneck: each row is the host time of one call (µs, the best of 5 rounds of ``--calls`` calls,
no synchronisation inside a round). For each truefuse op the Triton launches it makes are recorded
and replayed three ways: ``jit.run`` (Triton's own path), ``handle`` (the compiled kernel's ``run``
with the bound arguments precomputed: the floor of any launch), and ``handle+key`` (the same with
Triton's specialisation flags computed in Python each call, what a launch cache of truefuse's own
would pay at least: on an H100 host 15-23 µs against Triton's 17-26, and a full cache keyed on the
exact arguments measured 19-28 µs, slower than Triton's own path, so the ops launch through Triton).

Run on a GPU: ``python experiments/exp_launch_host.py [--calls 2000] [--profile]``.
"""

import argparse
import time


def host_time_us(fn, calls: int, warmup: int = 20) -> float:
    """µs of host per ``fn()``: the best of 5 rounds of ``calls`` calls, no synchronisation inside a
    round (the GPU work queued, so the wall time is the host's wherever the host is slower)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls * 1e6)
        torch.cuda.synchronize()
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--profile", action="store_true", help="cProfile each truefuse op's calls")
    args = p.parse_args()

    import torch
    import torch.nn.functional as F
    from triton import knobs
    from triton.runtime.jit import JITFunction

    import truefuse
    from truefuse.autograd.gated_activation import gated_activation
    from truefuse.autograd.norm import rms_norm, rms_norm_hf
    from truefuse.autograd.rope import apply_rotary_pos_emb
    from truefuse.integrations.huggingface.attention import attention_forward
    from truefuse.integrations.huggingface.batch_invariant import running_batch_invariant

    dev, bf = "cuda", torch.bfloat16
    torch.manual_seed(0)
    H, B = 2048, 4
    x = torch.randn(B, 1, H, device=dev, dtype=bf)
    w = torch.randn(H, H, device=dev, dtype=bf) * 0.02
    nw = torch.ones(H, device=dev, dtype=bf)
    q = torch.randn(B, 1, 16, 64, device=dev, dtype=bf).transpose(1, 2)
    k = torch.randn(B, 1, 8, 64, device=dev, dtype=bf).transpose(1, 2)
    cos = torch.randn(B, 1, 64, device=dev, dtype=bf)
    sin = torch.randn(B, 1, 64, device=dev, dtype=bf)
    g = torch.randn(B, 1, 5632, device=dev, dtype=bf)
    u = torch.randn(B, 1, 5632, device=dev, dtype=bf)

    # decode attention: 16/8 heads of 64 against 256 cached keys, transformers' bool mask
    qa = torch.randn(B, 16, 1, 64, device=dev, dtype=bf)
    ka, va = (torch.randn(B, 8, 256, 64, device=dev, dtype=bf) for _ in range(2))
    mask = torch.ones(B, 1, 1, 256, device=dev, dtype=torch.bool)
    mask[0, ..., :5] = False
    module = torch.nn.Module()
    module.is_causal = True

    def stock_norm():
        h = x.to(torch.float32)
        var = h.pow(2).mean(-1, keepdim=True)
        return nw * (h * torch.rsqrt(var + 1e-6)).to(bf)

    def rot(t):
        return torch.cat((-t[..., 32:], t[..., :32]), dim=-1)

    def stock_rope():
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * c + rot(q) * s, k * c + rot(k) * s

    def bi_linear():
        with running_batch_invariant():
            return F.linear(x, w)

    rows = {
        "F.linear (cuBLAS)": (lambda: F.linear(x, w), None),
        "gemm BI": (None, lambda: truefuse.gemm(x.view(B, H), w.t(), batch_invariant=True)),
        "F.linear routed BI": (None, bi_linear),
        "rms norm stock ops": (stock_norm, None),
        "rms_norm_hf": (None, lambda: rms_norm_hf(x, nw, 1e-6)),
        "rms_norm": (None, lambda: rms_norm(x, nw, 1e-6)),
        "rope stock ops": (stock_rope, None),
        "apply_rotary_pos_emb": (None, lambda: apply_rotary_pos_emb(q, k, cos, sin)),
        "silu(g)*u stock": (lambda: F.silu(g) * u, None),
        "swiglu": (None, lambda: gated_activation(g, "swiglu", u)),
        "SDPA decode": (lambda: F.scaled_dot_product_attention(qa, ka, va, attn_mask=mask, enable_gqa=True), None),
        "attention decode (HF)": (None, lambda: attention_forward(module, qa, ka, va, mask, scaling=0.125)),
        "torch.empty": (lambda: torch.empty(B, H, device=dev, dtype=bf), None),
    }

    def host_us(fn, calls=args.calls):
        return host_time_us(fn, calls)

    records: list = []
    orig_run = JITFunction.run

    def recording_run(self, *a, grid, warmup, **kw):
        kernel = orig_run(self, *a, grid=grid, warmup=warmup, **kw)
        records.append((self, a, dict(kw), grid, kernel))
        return kernel

    torch.set_grad_enabled(False)
    print(f"{'row':26s} {'host us':>9s}  launches: jit.run / handle / handle+key us")
    for name, (stock, ours) in rows.items():
        fn = stock or ours
        us = host_us(fn)
        line = f"{name:26s} {us:9.1f}"
        if ours is not None:
            records.clear()
            JITFunction.run = recording_run
            try:
                ours()
            finally:
                JITFunction.run = orig_run
            for jit, a, kw, grid, kernel in records:
                line += "  " + _replay(jit, a, kw, grid, kernel, host_us, torch, knobs)
        print(line, flush=True)
    if args.profile:
        import cProfile
        import pstats

        for name, (_, ours) in rows.items():
            if ours is None:
                continue
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(500):
                ours()
            pr.disable()
            print(f"--- cProfile: {name} (500 calls)")
            pstats.Stats(pr).sort_stats("tottime").print_stats(14)


def _replay(jit, a, kw, grid, kernel, host_us, torch, knobs) -> str:
    """One recorded launch timed three ways (see the module's docstring)."""
    opts = {k: v for k, v in kw.items() if k not in {p.name for p in jit.params}}
    names = [p.name for p in jit.params]
    bound = list(a) + [kw[n] if n in kw else jit.params[i].default for i, n in enumerate(names) if i >= len(a)]
    g = grid(dict(zip(names, bound, strict=False))) if callable(grid) else grid
    g0, g1, g2 = g[0], g[1] if len(g) > 1 else 1, g[2] if len(g) > 2 else 1
    dev = torch.cuda.current_device()

    def via_jit():
        jit.run(*a, grid=grid, warmup=False, **kw)

    def via_handle():
        stream = torch.cuda.current_stream(dev).cuda_stream
        kernel.run(g0, g1, g2, stream, kernel.function, kernel.packed_metadata, None,
                   knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *bound)  # fmt: skip

    cache = {}

    def key_of(vals):
        out = []
        for v in vals:
            if isinstance(v, torch.Tensor):
                out.append((v.dtype, v.data_ptr() % 16 == 0))
            elif isinstance(v, int) and not isinstance(v, bool):
                out.append((v == 1, v % 16 == 0, -(2**31) <= v < 2**31))
            else:
                out.append(v)
        return tuple(out), tuple(opts.items())

    cache[key_of(bound)] = kernel

    def via_key():
        kern = cache[key_of(bound)]
        stream = torch.cuda.current_stream(dev).cuda_stream
        kern.run(g0, g1, g2, stream, kern.function, kern.packed_metadata, None,
                 knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *bound)  # fmt: skip

    times = (host_us(f) for f in (via_jit, via_handle, via_key))
    return f"{jit.fn.__name__}: " + " / ".join(f"{t:.1f}" for t in times)


if __name__ == "__main__":
    main()
