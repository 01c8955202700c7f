"""Contract cases of ``sibling_linears`` (docs/sibling_linears.md): the outputs bitwise the stock
calls (``sibling_linears_ref``), the weight and bias gradients bitwise torch's linear backward's (the
reference under autograd), ``x``'s gradient bounded against float64 with the reference under
autograd (autograd's separate adds) as the baseline; in batch-invariant mode the routed Linear's
bits and a sequence's rows its own. Three projections of one input, as q/k/v: odd sizes, a bias
on one, a (batch, sequence, hidden) input."""

from __future__ import annotations

import torch

from truefuse.autograd._wgrad import WgradState
from truefuse.autograd.linear import linear
from truefuse.autograd.sibling_linears import sibling_linears
from truefuse.config import batch_invariant
from truefuse.ops.gemm.siblings import sibling_linears_ref
from truefuse.testing import bitwise_report, bounded_report
from truefuse.verify.registry import register

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_SHAPE, _K, _NS = (3, 37), 200, (200, 72, 72)


def _inputs(dtype, device):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(*_SHAPE, _K, generator=g)
    ws = [torch.randn(n, _K, generator=g) / _K**0.5 for n in _NS]
    bs = [torch.randn(_NS[0], generator=g), None, None]
    dys = [torch.randn(*_SHAPE, n, generator=g) for n in _NS]
    return [t if t is None else t.to(device, dtype) for t in (x, *ws, *bs, *dys)]


def _run(fn, x, ws, bs, dys):
    leaves = [t if t is None else t.detach().clone().requires_grad_() for t in (x, *ws, *bs)]
    k = len(ws)
    outs = fn(leaves[0], leaves[1 : 1 + k], leaves[1 + k :])
    grads = torch.autograd.grad(outs, [t for t in leaves if t is not None], dys)
    return [o.detach() for o in outs], grads


def _results(dtype, device):
    x, *rest = _inputs(dtype, device)
    ws, bs, dys = rest[:3], rest[3:6], rest[6:]
    got = _run(sibling_linears, x, ws, bs, dys)
    want = _run(sibling_linears_ref, x, ws, bs, dys)
    return x, ws, bs, dys, got, want


def _bits_case(dtype):
    """The outputs, weight and bias gradients: the stock calls' bits."""

    def case(device):
        *_, (outs, (_, *dparams)), (want_outs, (_, *want_dparams)) = _results(dtype, device)
        report = {f"out{i}": bitwise_report(o, w) for i, (o, w) in enumerate(zip(outs, want_outs, strict=True))}
        names = [f"dweight{i}" for i in range(3)] + ["dbias0"]
        return report | {n: bitwise_report(g, w) for n, g, w in zip(names, dparams, want_dparams, strict=True)}

    return case


def _dx_case(dtype):
    """x's gradient, summed in the GEMMs, against float64; autograd's adds the baseline."""

    def case(device):
        x, ws, bs, dys, (_, (dx, *_)), (_, (want_dx, *_)) = _results(dtype, device)
        f64 = [t if t is None else t.detach().cpu().double() for t in (x, *ws, *bs, *dys)]
        _, (ref_dx, *_) = _run(sibling_linears_ref, f64[0], f64[1:4], f64[4:7], f64[7:])
        return {"dx": bounded_report(dx, ref_dx, want_dx)}

    return case


for _dn, _dt in _DTYPES.items():
    register("sibling_linears", f"fwd_wgrad_{_dn}", "bitwise")(_bits_case(_dt))
    register("sibling_linears", f"dx_{_dn}", "bounded")(_dx_case(_dt))


def _bi_case(dtype):
    """Batch-invariant mode (``truefuse.batch_invariant()``): each output, weight and bias gradient
    the routed Linear's bits (``autograd/linear.py::linear``, a batch-invariant model's
    ``F.linear``); a sequence alone and in the batch, its outputs and its rows of ``x``'s gradient
    the same bits."""

    def case(device):
        x, *rest = _inputs(dtype, device)
        ws, bs, dys = rest[:3], rest[3:6], rest[6:]
        with batch_invariant():
            got = _run(sibling_linears, x, ws, bs, dys)
            state = WgradState(owner="verify")  # plain: autograd's .grad, as the routed F.linear's
            routed = _run(lambda x, ws, bs: [linear(x, w, b, state=state) for w, b in zip(ws, bs, strict=True)], x, ws, bs, dys)
            alone = _run(sibling_linears, x[1:2], ws, bs, [d[1:2] for d in dys])
        (outs, (dx, *dparams)), (want_outs, (_, *want_dparams)) = got, routed
        report = {f"out{i}": bitwise_report(o, w) for i, (o, w) in enumerate(zip(outs, want_outs, strict=True))}
        names = [f"dweight{i}" for i in range(3)] + ["dbias0"]
        report |= {n: bitwise_report(g, w) for n, g, w in zip(names, dparams, want_dparams, strict=True)}
        report |= {f"alone_out{i}": bitwise_report(a[0], o[1]) for i, (a, o) in enumerate(zip(alone[0], outs, strict=True))}
        return report | {"alone_dx": bitwise_report(alone[1][0][0], dx[1])}

    return case


for _dn, _dt in _DTYPES.items():
    register("sibling_linears", f"batch_invariant_{_dn}", "bitwise")(_bi_case(_dt))
