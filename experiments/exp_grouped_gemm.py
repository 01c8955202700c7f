"""Issue 16 (items 1-2): the batch-invariant Triton grouped GEMM as GroupedMLP's default, on one GPU.

Run on the H200: ``python experiments/exp_grouped_gemm.py [--quick]``. Three parts:

1. ``verify --op grouped_gemm`` on CUDA (bf16/fp16/fp32 bounded against one GEMM per group, and the
   batch-invariance bitwise checks), printed as rows.
2. Timing: ``truefuse bench grouped``'s sweep (GroupedMLP swiglu forward + backward, bf16, packed
   weights; 8 × 2048 (4096/14336), 64 × 256 (2048/1408), 128 × 128 (2048/768)), providers
   ``truefuse`` (default: triton), ``truefuse_device_splits``, ``truefuse_per_group``,
   ``truefuse_fused_grouped`` (cuBLAS grouped_mm), ``*_main_grad`` (fuse_wgrad_accumulation),
   ``torch_loop``, each as a ratio to ``floor``: the six grouped GEMMs alone on cuBLAS
   ``grouped_mm`` (torch._grouped_mm through ``truefuse.gemm``'s default plan).
3. CUDA graphs: GroupedMLP (backend triton, m_splits a CUDA tensor) forward + backward captured
   once and replayed with new routings written into the same splits tensor: every output and
   gradient equals eager bit for bit (with and without fused main_grad).
"""

from __future__ import annotations

import argparse

import torch

from truefuse.nn.grouped import GroupedMLP
from truefuse.verify.registry import all_cases


def verify_rows(device):
    print("== verify --op grouped_gemm ==")
    ok = True
    for case in all_cases(["grouped_gemm"], device.type):
        for label, rep in case.fn(device).items():
            ok &= rep.passed
            extra = f" ratio={rep.ratio:.3f}" if hasattr(rep, "ratio") else ""
            print(f"{case.name}/{label}: {'PASS' if rep.passed else 'FAIL'} max_diff={rep.max_diff:.3e}{extra}")
    print("all PASS" if ok else "SOME FAIL")
    return ok


def timing(device, quick: bool):
    from truefuse.bench.bench_grouped import sweep

    print("== GroupedMLP forward + backward (ratio: time / floor = cuBLAS grouped_mm GEMMs) ==")
    s = sweep(quick)
    s.run(device)
    s.print()


def _routing(E, tokens, seed, device):
    """A random routing of E * tokens rows over E experts (some empty)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(E, generator=g) ** 3
    w[torch.randint(0, E, (max(1, E // 8),), generator=g)] = 0
    counts = torch.distributions.Multinomial(E * tokens, probs=w / w.sum()).sample().long()
    return counts.to(device)


def cuda_graph_check(device, E, tokens, H, F, fused: bool) -> bool:
    torch.manual_seed(0)
    M = E * tokens
    m = GroupedMLP(E, H, F, device=device, dtype=torch.bfloat16, single_grouped_weight=True, fuse_wgrad_accumulation=fused)
    assert m._resolve_path(device, torch.bfloat16, True) == "triton"
    params = list(m.parameters())
    weights = [p for _, p in m.gemm_weights()]
    if fused:
        for p in weights:
            p.main_grad = torch.zeros(p.shape, device=device)
    x = (torch.randn(M, H, device=device, dtype=torch.bfloat16) * 0.5).requires_grad_()
    dy = torch.randn(M, H, device=device, dtype=torch.bfloat16) * 0.02
    splits = _routing(E, tokens, 0, device)

    def step():
        y = m(x, splits)
        grads = torch.autograd.grad(y, [x, *params], dy, allow_unused=True)
        return [y, *grads]

    def eager():
        if fused:
            for p in weights:
                p.main_grad.zero_()
        outs = [t.clone() if t is not None else None for t in step()]
        mg = [p.main_grad.clone() for p in weights] if fused else []
        return outs + mg

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()  # compile the kernels, fill the caches
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    ok = True
    for seed in range(4):
        splits.copy_(_routing(E, tokens, seed, device))
        want = eager()
        if fused:
            for p in weights:
                p.main_grad.zero_()
        graph.replay()
        torch.cuda.synchronize()
        got = [t.clone() if t is not None else None for t in static] + ([p.main_grad.clone() for p in weights] if fused else [])
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            if (a is None) != (b is None) or (a is not None and not torch.equal(a, b)):
                ok = False
                print(f"  routing {seed}: output {i} differs")
    print(f"CUDA graph {E}x{tokens} h{H} f{F} fused_main_grad={fused}: {'bitwise equal to eager' if ok else 'DIFFERS'}")
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-timing", action="store_true")
    args = ap.parse_args()
    device = torch.device("cuda")
    ok = verify_rows(device)
    print("== CUDA graph capture + replay, device splits ==")
    for fused in (False, True):
        ok &= cuda_graph_check(device, 64, 256, 2048, 1408, fused)
    if not args.skip_timing:
        timing(device, args.quick)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
