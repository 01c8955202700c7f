"""Would SwiGLU computed in the gate/up GEMM's epilogue beat the GEMMs plus the separate kernel
(issue 48.2, "measure before you choose")?

A prototype, not the library: a persistent Triton kernel with TMA descriptors (the form of
``kernels/gemm_tma.py``) that loads each ``x`` tile once and reduces it against the gate and the up
weight into two fp32 accumulators, then in its epilogue rounds them as the stock modules do
(``g = bf16(x Wgᵀ)``, ``u = bf16(x Wuᵀ)``, ``h = bf16(bf16(silu(g)) · u)``: transformers'
``act_fn(gate_proj(x)) * up_proj(x)``) and writes ``h``, optionally ``g`` and ``u`` too (what a
backward that does not recompute needs). Timed against, in the same process, round-robin
(``do_bench`` medians, the middle of 3 rounds):

* ``stock``: ``F.linear`` twice (cuBLAS), ``F.silu(g) * u`` (two kernels);
* ``truefuse``: ``F.linear`` twice, ``truefuse.gated_activation(g, "swiglu", u)`` (one kernel);
* ``fused w``: one cuBLAS GEMM against ``[Wg; Wu]`` (N = 2I), then ``gated_activation`` of its halves;
* ``epilogue`` / ``epilogue+gu``: the prototype without / with ``g`` and ``u`` written.

Also checked: the epilogue against stock's rounding applied to the prototype's own ``g`` and ``u``
(the share of elements that differ: Triton's ``sigmoid`` and torch's ``silu`` may part by an fp32
ulp, which the bf16 rounding mostly hides), and ``h`` against stock's (relative error: the GEMM's
accumulation order differs from cuBLAS's).

    PYTHONPATH=. python experiments/exp_gated_gemm.py [--m 8192 --k 2048 --i 5632]   # one H100 (demo's MLP)
    TRITON_INTERPRET=1 PYTHONPATH=. python experiments/exp_gated_gemm.py --smoke      # the CPU, fp32, tiny
"""

from __future__ import annotations

import argparse

import triton
import triton.language as tl

from truefuse.kernels.activation import act_value
from truefuse.kernels.gemm import banded_tile


@triton.jit
def _swiglu_gemm_kernel(
    x_ptr, wg_ptr, wu_ptr, h_ptr, g_ptr, u_ptr, M, N, K, stride_xm, stride_wn, stride_hm,
    SAVE_GU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, IEEE: tl.constexpr = False,
):  # fmt: skip
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_xm, 1], block_shape=[BLOCK_M, BLOCK_K])
    g_desc = tl.make_tensor_descriptor(wg_ptr, shape=[N, K], strides=[stride_wn, 1], block_shape=[BLOCK_N, BLOCK_K])
    u_desc = tl.make_tensor_descriptor(wu_ptr, shape=[N, K], strides=[stride_wn, 1], block_shape=[BLOCK_N, BLOCK_K])
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(pid, num_m * num_n, nprog, flatten=True):
        pm, pn = banded_tile(tile, num_m, num_n, GROUP_M)
        m0 = pm * BLOCK_M
        n0 = pn * BLOCK_N
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = x_desc.load([m0, k0])
            bg = g_desc.load([n0, k0]).T
            bu = u_desc.load([n0, k0]).T
            if IEEE:
                acc_g = tl.dot(a, bg, acc_g, input_precision="ieee")
                acc_u = tl.dot(a, bu, acc_u, input_precision="ieee")
            else:
                acc_g = tl.dot(a, bg, acc_g)
                acc_u = tl.dot(a, bu, acc_u)
        dt = h_ptr.dtype.element_ty
        g = acc_g.to(dt)  # the stock GEMMs' outputs, rounded
        u = acc_u.to(dt)
        gf = g.to(tl.float32)
        act = act_value(gf, 4).to(dt)  # silu of the rounded gate (the library's formula), rounded
        h = (act.to(tl.float32) * u.to(tl.float32)).to(dt)  # the product, rounded
        rm = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        rn = n0 + tl.arange(0, BLOCK_N)
        mask = (rm < M)[:, None] & (rn < N)[None, :]
        offs = rm[:, None] * stride_hm + rn[None, :]
        tl.store(h_ptr + offs, h, mask=mask)
        if SAVE_GU:
            tl.store(g_ptr + offs, g, mask=mask)
            tl.store(u_ptr + offs, u, mask=mask)


def swiglu_gemm(x, wg, wu, save_gu: bool, tile=(128, 128, 64, 8, 3), programs=None):
    """``h`` (and ``g``, ``u`` when ``save_gu``) of ``x`` (M, K) against ``wg``, ``wu`` (N, K)."""
    import torch

    from truefuse.ops.gemm.gemm_backends.triton import _tma_scratch

    (M, K), N = x.shape, wg.shape[0]
    bm, bn, bk, warps, stages = tile
    h = torch.empty(M, N, device=x.device, dtype=x.dtype)
    g, u = (torch.empty_like(h), torch.empty_like(h)) if save_gu else (h, h)
    tiles = -(-M // bm) * -(-N // bn)
    grid = (min(tiles, programs or tiles),)
    with _tma_scratch(x.device):
        _swiglu_gemm_kernel[grid](
            x, wg, wu, h, g, u, M, N, K, x.stride(0), wg.stride(0), h.stride(0),
            SAVE_GU=save_gu, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, IEEE=x.dtype == torch.float32,
            num_warps=warps, num_stages=stages,
        )  # fmt: skip
    return (h, g, u) if save_gu else (h,)


def stock_rounding(g, u):
    """transformers' ``act_fn(gate) * up`` on given ``g``, ``u``: silu rounded, then the product rounded."""
    import torch.nn.functional as F

    return F.silu(g) * u


def smoke() -> None:
    """The CPU under the interpreter, fp32, a ragged tiny shape: h against the reference, and the
    epilogue's rounding against stock's on the kernel's own g and u."""
    import torch

    torch.manual_seed(0)
    M, K, N = 37, 48, 40
    x, wg, wu = torch.randn(M, K), torch.randn(N, K) * 0.1, torch.randn(N, K) * 0.1
    h, g, u = swiglu_gemm(x, wg, wu, True, tile=(16, 16, 16, 4, 1))
    ref = stock_rounding(x @ wg.t(), x @ wu.t())
    err = float((h - ref).abs().max())
    epi = float((h - stock_rounding(g, u)).abs().max())
    print(f"smoke: max |h - ref| {err:.2e}, max |h - stock rounding of its g, u| {epi:.2e} (fp32)")
    assert err < 1e-4 and epi < 1e-6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, default=8192, help="tokens")
    p.add_argument("--k", type=int, default=2048, help="hidden")
    p.add_argument("--i", type=int, default=5632, help="intermediate")
    p.add_argument("--smoke", action="store_true", help="the CPU, fp32, under TRITON_INTERPRET=1")
    args = p.parse_args()
    if args.smoke:
        smoke()
        return

    import torch
    import torch.nn.functional as F
    from triton.testing import do_bench

    import truefuse

    bf, dev = torch.bfloat16, "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(args.m, args.k, device=dev, generator=gen).to(bf)
    wg, wu = ((torch.randn(args.i, args.k, device=dev, generator=gen) * 0.02).to(bf) for _ in range(2))
    w2 = torch.cat([wg, wu])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tiles = [(128, 128, 64, 8, 3), (128, 64, 64, 4, 4), (128, 64, 64, 8, 4), (64, 128, 64, 4, 4), (128, 128, 64, 8, 4)]

    def fused_w():
        gu = F.linear(x, w2)
        return truefuse.gated_activation(gu[:, : args.i], "swiglu", gu[:, args.i :])

    runs = {
        "stock": lambda: F.silu(F.linear(x, wg)) * F.linear(x, wu),
        "truefuse": lambda: truefuse.gated_activation(F.linear(x, wg), "swiglu", F.linear(x, wu)),
        "fused w": fused_w,
    }
    for t in tiles:
        for save in (False, True):
            name = f"epilogue{'+gu' if save else ''} {t[0]}x{t[1]}x{t[2]} w{t[3]} s{t[4]}"
            runs[name] = lambda t=t, save=save: swiglu_gemm(x, wg, wu, save, t, sms)
    h_ref = runs["stock"]()
    ok = {}
    for name, fn in list(runs.items()):
        try:
            out = fn()
        except Exception as e:  # a tile this Triton cannot compile
            print(f"# {name}: {type(e).__name__}: {str(e)[:160]}")
            del runs[name]
            continue
        if name.startswith("epilogue+gu"):
            h, g, u = out
            ok[name] = f"{float((h != stock_rounding(g, u)).float().mean()):.1e}"
            out = h
        elif isinstance(out, tuple):
            out = out[0]
        rel = float((out.float() - h_ref.float()).norm() / h_ref.float().norm())
        ok[name] = (ok.get(name, "-"), rel)
    times = {n: [] for n in runs}
    for r in range(3):
        order = list(runs) if r % 2 == 0 else list(runs)[::-1]
        for n in order:
            times[n].append(do_bench(runs[n], warmup=10, rep=60))
    flops = 2 * 2 * args.m * args.k * args.i
    base = sorted(times["truefuse"])[1]
    versions = f"torch {torch.__version__}, triton {triton.__version__}"
    print(f"M {args.m}, K {args.k}, I {args.i}, bf16, {torch.cuda.get_device_name()}, {versions}")
    head = f"{'run':34s} {'ms':>8s} {'TFLOP/s':>8s} {'x truefuse':>10s}"
    print(head + "  rel err vs stock, share differing from stock's rounding of its g, u")
    for n, ts in times.items():
        ms = sorted(ts)[1]
        same, rel = ok[n]
        print(f"{n:34s} {ms:8.3f} {flops / ms / 1e9:8.1f} {base / ms:10.3f}  {rel:.2e} {same}")


if __name__ == "__main__":
    main()
