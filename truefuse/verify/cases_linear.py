"""Contract cases of the linear-family modules (docs/design.md §1, §2).

* ``fwd_bwd``: output, input gradient and every parameter gradient, bounded against the module's
  ``forward_ref`` on float64 copies, with ``forward_ref`` in the module's dtype as the baseline.
* ``delayed_vs_immediate``: ``delay_wgrad_compute`` + ``backward_dw()`` gives the same bits as the
  immediate backward, into a random fp32 ``main_grad`` and into ``param.grad``.
* ``main_grad``: fused fp32 accumulation into a random ``main_grad``, bounded against float64 with
  "bf16 weight gradient, then an fp32 add" as the baseline.

The helpers here (:data:`MODULES`, :func:`build`, :func:`tokens`, :func:`inputs_for`, :func:`run_module`,
:func:`to_float64`, :func:`attach_main_grads`) and the case builders (:func:`fwd_bwd_case`,
:func:`delayed_vs_immediate_case`, :func:`main_grad_case`) are shared with the tests.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from truefuse.nn.grouped import GroupedLinear, GroupedMLP
from truefuse.nn.layernorm_linear import LayerNormLinear
from truefuse.nn.layernorm_mlp import LayerNormMLP
from truefuse.nn.linear import Linear
from truefuse.testing import bitwise_report, bounded_report
from truefuse.verify.registry import register

_H, _F, _N = 96, 80, 72  # hidden, ffn, out features


def tokens(device) -> tuple[int, int]:
    """The input's leading dimensions: 3 x 41 on a GPU; 3 x 7 on the CPU, whose interpreter runs
    the norm and activation kernels a program per row (the norm backward's CPU grid still gets
    several two-row tiles a program and a shorter last program)."""
    return (3, 41) if torch.device(device).type == "cuda" else (3, 7)


def splits(device) -> list[int]:
    """The grouped modules' groups of the :func:`tokens` rows: an empty group and a group of one row."""
    return [40, 0, 1, 82] if torch.device(device).type == "cuda" else [6, 0, 1, 14]


class WithSplits(torch.nn.Module):
    """A grouped module with ``m_splits`` bound, so the single-input module cases (and the
    weight-gradient contract test) run over it unchanged."""

    def __init__(self, inner: torch.nn.Module, splits: list[int]) -> None:
        super().__init__()
        self.inner, self.splits = inner, splits

    def _call(self, fn, x):
        return fn(x.reshape(-1, x.shape[-1]), self.splits).view(*x.shape[:-1], -1)

    def forward(self, x):
        return self._call(self.inner, x)

    def forward_ref(self, x):
        return self._call(self.inner.forward_ref, x)

    def gemm_weights(self):
        return [(f"inner.{n}", p) for n, p in self.inner.gemm_weights()]

    def backward_dw(self):
        self.inner.backward_dw()

    def register_wgrad_hook(self, fn):
        return self.inner.register_wgrad_hook(fn)


#: name -> factory(dtype, device, **wgrad options) of a module covering one configuration.
MODULES: dict[str, Callable[..., torch.nn.Module]] = {
    "Linear": lambda dt, dev, **kw: Linear(_H, _N, device=dev, dtype=dt, **kw),
    "Linear/nobias": lambda dt, dev, **kw: Linear(_H, _N, bias=False, device=dev, dtype=dt, **kw),
    "LayerNormLinear": lambda dt, dev, **kw: LayerNormLinear(_H, _N, device=dev, dtype=dt, **kw),
    "LayerNormLinear/rms_zc_out": lambda dt, dev, **kw: LayerNormLinear(
        _H,
        _N,
        bias=False,
        device=dev,
        dtype=dt,
        normalization="RMSNorm",
        zero_centered_gamma=True,
        return_layernorm_output=True,
        **kw,
    ),
    "LayerNormMLP/gelu": lambda dt, dev, **kw: LayerNormMLP(_H, _F, device=dev, dtype=dt, **kw),
    "LayerNormMLP/rms_swiglu": lambda dt, dev, **kw: LayerNormMLP(
        _H, _F, bias=False, device=dev, dtype=dt, normalization="RMSNorm", activation="swiglu", **kw
    ),
    "GroupedLinear/per_group": lambda dt, dev, **kw: WithSplits(
        GroupedLinear(4, _H, _N, device=dev, dtype=dt, **kw), splits(dev)
    ),
    "GroupedLinear/packed": lambda dt, dev, **kw: WithSplits(
        GroupedLinear(4, _H, _N, device=dev, dtype=dt, single_grouped_weight=True, **kw), splits(dev)
    ),
    "GroupedMLP/per_group_swiglu": lambda dt, dev, **kw: WithSplits(
        GroupedMLP(4, _H, _F, device=dev, dtype=dt, **kw), splits(dev)
    ),
    "GroupedMLP/packed_gelu_bias": lambda dt, dev, **kw: WithSplits(
        GroupedMLP(4, _H, _F, bias=True, device=dev, dtype=dt, activation="gelu", single_grouped_weight=True, **kw), splits(dev)
    ),
}


def build(name: str, dtype: torch.dtype, device, seed: int = 0, **kw) -> torch.nn.Module:
    """A module of :data:`MODULES` with seeded random parameters (norm weights away from 1)."""
    torch.manual_seed(seed)
    m = MODULES[name](dtype, device, **kw)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.startswith("layer_norm"):
                p.copy_(
                    torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + 7)) * 0.5 + (0 if "bias" in n else 0.2)
                )
    return m


def inputs_for(m: torch.nn.Module, dtype, device, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, dy): a random input and upstream gradient of the module's output shape."""
    g = torch.Generator().manual_seed(seed)
    features = m.gemm_weights()[0][1].shape[-1]
    x = torch.randn(*tokens(device), features, generator=g).to(device, dtype)
    with torch.no_grad():
        out = m.forward_ref(x)
    out = out[0] if isinstance(out, tuple) else out
    return x, torch.randn(out.shape, generator=g).to(device, dtype)


def run_module(m: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor, *, ref: bool = False) -> dict[str, torch.Tensor]:
    """Forward (``forward_ref`` when ``ref``) and backward with upstream ``dy`` (and a fixed second
    upstream gradient for a returned norm output); returns out, dx and each parameter's ``.grad``."""
    x = x.detach().clone().requires_grad_()
    y = m.forward_ref(x) if ref else m(x)
    if isinstance(y, tuple):  # (out, ln_out): gradients flow into both
        dln = torch.full_like(y[1], 0.25)
        torch.autograd.backward([y[0], y[1]], [dy, dln])
        y = y[0]
    else:
        y.backward(dy)
    res = {"out": y.detach(), "dx": x.grad}
    res.update({f"d{n}": p.grad for n, p in m.named_parameters() if p.grad is not None})
    return res


def to_float64(m: torch.nn.Module) -> torch.nn.Module:
    """A float64 CPU copy of ``m`` (the reference's module); ``m`` is left as it is."""
    return copy.deepcopy(m).to(device="cpu", dtype=torch.float64)


def fwd_bwd_case(name, dtype):
    """The ``fwd_bwd`` case of module ``name`` in ``dtype``: a function of the device."""

    def case(device):
        m = build(name, dtype, device)
        x, dy = inputs_for(m, dtype, device)
        got = run_module(m, x, dy)
        base = run_module(build(name, dtype, device), x, dy, ref=True)
        ref = run_module(to_float64(m), x.cpu().double(), dy.cpu().double(), ref=True)
        return {k: bounded_report(got[k], ref[k], base[k]) for k in got}

    return case


def attach_main_grads(m: torch.nn.Module, seed: int = 3, attr: bool = False) -> dict[str, torch.Tensor]:
    """Give every GEMM weight a random fp32 ``main_grad`` (and ``grad_added_to_main_grad=False`` when
    ``attr``); returns copies of the starting values."""
    start = {}
    for i, (n, p) in enumerate(m.gemm_weights()):
        p.main_grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + i)).to(p.device)
        start[n] = p.main_grad.clone()
        if attr:
            p.grad_added_to_main_grad = False
    return start


def delayed_vs_immediate_case(name, dtype, fused: bool):
    """The ``delayed_vs_immediate_{main_grad if fused else grad}`` case: a function of the device."""

    def case(device):
        results = []
        for delay in (False, True):
            m = build(name, dtype, device, fuse_wgrad_accumulation=fused, delay_wgrad_compute=delay)
            if fused:
                attach_main_grads(m)
            x, dy = inputs_for(m, dtype, device)
            res = run_module(m, x, dy)
            m.backward_dw()
            res.update({f"d{n}": p.grad for n, p in m.gemm_weights() if p.grad is not None})
            if fused:
                res.update({f"{n}.main_grad": p.main_grad for n, p in m.gemm_weights()})
            results.append(res)
        imm, dly = results
        if imm.keys() != dly.keys():
            raise AssertionError(f"different gradients returned: {sorted(imm)} vs {sorted(dly)}")
        return {k: bitwise_report(dly[k], imm[k]) for k in imm}

    return case


def main_grad_case(name, dtype):
    """The ``main_grad`` case of module ``name`` in ``dtype``: a function of the device."""

    def case(device):
        m = build(name, dtype, device, fuse_wgrad_accumulation=True)
        start = attach_main_grads(m)
        x, dy = inputs_for(m, dtype, device)
        run_module(m, x, dy)
        plain = run_module(build(name, dtype, device), x, dy)  # weight gradients in the param dtype
        ref = run_module(to_float64(m), x.cpu().double(), dy.cpu().double(), ref=True)
        return {
            f"{n}.main_grad": bounded_report(
                p.main_grad, start[n].cpu().double() + ref[f"d{n}"], start[n] + plain[f"d{n}"].float()
            )
            for n, p in m.gemm_weights()
        }

    return case


_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
for _mod in MODULES:
    _op, _, _variant = _mod.partition("/")  # the op is the module; the variant names the case
    _pre = f"{_variant}_" if _variant else ""
    for _dn, _dt in _DTYPES.items():
        register(_op, f"{_pre}fwd_bwd_{_dn}", "bounded")(fwd_bwd_case(_mod, _dt))
        register(_op, f"{_pre}delayed_vs_immediate_main_grad_{_dn}", "bitwise")(delayed_vs_immediate_case(_mod, _dt, True))
        register(_op, f"{_pre}delayed_vs_immediate_grad_{_dn}", "bitwise")(delayed_vs_immediate_case(_mod, _dt, False))
        register(_op, f"{_pre}main_grad_{_dn}", "bounded")(main_grad_case(_mod, _dt))
