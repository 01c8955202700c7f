"""``python -m truefuse bench adamw``, or ``python -m truefuse.bench.bench_adamw [OUT_DIR]``: one
AdamW step over a Llama's parameters in bf16 (hidden 2048, 16 layers, intermediate 8192, 8 KV
heads of 64, vocabulary 128256, untied head: 1.50 B parameters in 147 tensors), issue 48 item 4.

Providers, side by side in one run: ``floor`` (a device copy moving the step's minimal bytes: read
parameter, gradient and both moments, write parameter and both moments, 14 bytes a bf16 parameter),
torch's AdamW as users run it (``torch_foreach``: the default, ``foreach`` with host step counts),
``torch_foreach_capturable``, ``torch_fused`` (``fused=True``), ``torch_single_capturable``
(``foreach=False, capturable=True``: the path truefuse matches bit for bit) and ``truefuse``
(``truefuse.optim.AdamW``). GB/s counts those minimal bytes; ``ratio`` is time over the floor's.
``err_bits_differ``: the fraction of parameter elements whose bits differ from
``torch_single_capturable``'s after two steps from the same start (0 for truefuse by contract).

The CPU run (no GPU) is a smoke run of a tiny model, capturable off (torch refuses it there).
"""

from __future__ import annotations

import sys

import torch

from truefuse.bench.harness import Sweep, environment

MODELS = {
    "llama-1.5B": {"hidden": 2048, "layers": 16, "intermediate": 8192, "kv": 512, "vocab": 128256},
    "tiny": {"hidden": 64, "layers": 2, "intermediate": 128, "kv": 32, "vocab": 1000},
}
_BF = torch.bfloat16
_KW = {"lr": 1e-3, "weight_decay": 0.1}


def shapes(hidden: int, layers: int, intermediate: int, kv: int, vocab: int) -> list[tuple[int, ...]]:
    """A Llama's parameter shapes: embedding, per layer q, k, v, o, gate, up, down and two norms,
    the final norm, an untied head."""
    layer = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (intermediate, hidden),
             (intermediate, hidden), (hidden, intermediate), (hidden,), (hidden,)]  # fmt: skip
    return [(vocab, hidden), *layer * layers, (hidden,), (vocab, hidden)]


def _numel(p: dict) -> int:
    return sum(torch.Size(s).numel() for s in shapes(**MODELS[p["model"]]))


def _bytes(p: dict) -> float:
    return 14.0 * _numel(p)


def _tensors(p: dict, device):
    g = torch.Generator(device=device).manual_seed(0)
    params = [torch.randn(s, generator=g, device=device, dtype=_BF).requires_grad_() for s in shapes(**MODELS[p["model"]])]
    for q in params:
        q.grad = 0.01 * torch.randn(q.shape, generator=g, device=device, dtype=_BF)
    return params


def _optimizer(provider: str, params, device):
    from truefuse.optim import AdamW

    cap = device.type == "cuda"  # torch refuses capturable on the CPU
    if provider == "truefuse":
        return AdamW(params, **_KW)
    kw = {
        "torch_foreach": {"foreach": True},
        "torch_foreach_capturable": {"foreach": True, "capturable": cap},
        "torch_fused": {"fused": True},
        "torch_single_capturable": {"foreach": False, "capturable": cap},
    }[provider]
    return torch.optim.AdamW(params, **_KW, **kw)


def _provider(name: str):
    def make(p, device):
        opt = _optimizer(name, _tensors(p, device), device)
        return opt.step

    return make


def _floor(p, device):
    n = 7 * _numel(p)
    src, dst = torch.empty(n, dtype=torch.uint8, device=device), torch.empty(n, dtype=torch.uint8, device=device)
    return lambda: dst.copy_(src)


def _bits_differ(p, provider, device) -> dict:
    """Two steps from the same start, against torch_single_capturable's parameters."""
    if provider == "floor":
        return {}
    after = []
    for name in (provider, "torch_single_capturable"):
        params = _tensors(p, device)
        opt = _optimizer(name, params, device)
        opt.step(), opt.step()
        after.append([q.detach() for q in params])
        del opt
    differ = sum(int((a.view(torch.int16) != b.view(torch.int16)).sum()) for a, b in zip(*after, strict=True))
    return {"err_bits_differ": differ / _numel(p)}


def sweep(quick: bool) -> Sweep:
    point = {"model": "tiny" if quick else "llama-1.5B"}
    point["params_M"] = round(_numel(point) / 1e6, 1)
    providers = {"floor": _floor}
    for name in ("torch_foreach", "torch_foreach_capturable", "torch_fused", "torch_single_capturable", "truefuse"):
        providers[name] = _provider(name)
    return Sweep(
        name="adamw",
        points=[point],
        providers=providers,
        reference="floor",
        x="params_M",
        bytes=_bytes,
        accuracy=_bits_differ,
    )


def main(out_dir: str = "bench_results") -> None:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        print("bench_adamw: no GPU here; a CPU smoke run of a tiny model, not a measurement", file=sys.stderr)
    sw = sweep(quick=not cuda)
    sw.run(device)
    print("wrote " + ", ".join(str(p) for p in sw.save(out_dir, environment())))
    sw.print()
    rows = {r["provider"]: r for r in sw.rows}
    floor, ours = rows["floor"], rows["truefuse"]
    print(
        f"{sw.points[0]['params_M']} M bf16 parameters, {_bytes(sw.points[0]) / 1e9:.1f} GB a step: the copy floor "
        f"{floor['ms']:.2f} ms ({floor['gbps']:.0f} GB/s); truefuse {ours['ms']:.2f} ms ({ours['gbps']:.0f} GB/s, "
        f"{100 * floor['ms'] / ours['ms']:.0f}% of the floor's rate); torch foreach {rows['torch_foreach']['ms']:.2f} ms, "
        f"fused {rows['torch_fused']['ms']:.2f} ms"
    )


if __name__ == "__main__":
    main(*sys.argv[1:2])
