"""Contract case: ``GroupedLinear(backend="per_group")`` equals one ``truefuse.Linear`` per group bit
for bit on the same backend (docs/design.md §1): forward, input gradient, weight and bias gradients, per-group and packed
weights, with an empty group and a group of one row. (Bounded and §2 cases of the grouped modules
are in ``cases_linear`` with the other modules.)"""

from __future__ import annotations

import torch

from truefuse.nn.grouped import GroupedLinear
from truefuse.nn.linear import Linear
from truefuse.testing import bitwise_report
from truefuse.verify.registry import register


def grouped_vs_linear(dtype, device, *, packed: bool, splits: list[int], fused: bool = False, bias: bool = True, seed: int = 0):
    """Run a GroupedLinear and one Linear per group with the same weights; return bitwise reports."""
    K, N = 64, 48
    torch.manual_seed(seed)
    kw = {"fuse_wgrad_accumulation": fused}
    gl = GroupedLinear(
        len(splits), K, N, bias=bias, device=device, dtype=dtype, single_grouped_weight=packed, backend="per_group", **kw
    )
    lins = [Linear(K, N, bias=bias, device=device, dtype=dtype, **kw) for _ in splits]
    with torch.no_grad():
        for g, lin in enumerate(lins):
            w, b = gl._w.group(gl, g)
            lin.weight.copy_(w)
            if bias:
                lin.bias.copy_(b)
    if fused:
        for _, p in gl.gemm_weights():
            p.main_grad = torch.zeros(p.shape, device=device)
        for lin in lins:
            lin.weight.main_grad = torch.zeros(lin.weight.shape, device=device)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(sum(splits), K, generator=gen).to(device, dtype)
    dy = torch.randn(sum(splits), N, generator=gen).to(device, dtype)
    xg = x.clone().requires_grad_()
    yg = gl(xg, splits)
    yg.backward(dy)
    reports, start = {}, 0
    for g, (m, lin) in enumerate(zip(splits, lins, strict=True)):
        xl = x[start : start + m].clone().requires_grad_()
        yl = lin(xl)
        yl.backward(dy[start : start + m])
        reports[f"group{g}/out"] = bitwise_report(yg[start : start + m], yl)
        reports[f"group{g}/dx"] = bitwise_report(xg.grad[start : start + m], xl.grad)
        gw = gl.weight if packed else getattr(gl, f"weight{g}")
        wgrad = (gw.main_grad if fused else gw.grad)[g] if packed else (gw.main_grad if fused else gw.grad)
        reports[f"group{g}/dweight"] = bitwise_report(wgrad, lin.weight.main_grad if fused else lin.weight.grad)
        if bias:
            gb = gl.bias if packed else getattr(gl, f"bias{g}")
            reports[f"group{g}/dbias"] = bitwise_report(gb.grad[g] if packed else gb.grad, lin.bias.grad)
        start += m
    return reports


_SPLITS = [7, 0, 1, 30, 0, 2]
for _dn, _dt in {"bf16": torch.bfloat16, "fp32": torch.float32}.items():
    for _packed in (False, True):
        for _fused in (False, True):
            for _bias in (True, False):
                _name = f"equals_linear_{'packed' if _packed else 'per_group'}{'_main_grad' if _fused else ''}"
                _name += f"{'' if _bias else '_nobias'}_{_dn}"
                register("GroupedLinear", _name, "bitwise")(
                    lambda device, dt=_dt, pk=_packed, fu=_fused, bi=_bias: grouped_vs_linear(
                        dt, device, packed=pk, splits=_SPLITS, fused=fu, bias=bi
                    )
                )
