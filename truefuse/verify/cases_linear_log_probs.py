"""Contract cases of ``linear_log_probs`` (docs/design.md §1): the log-probs, the entropies and the
gradients of input, weight and bias under random per-token upstream gradients of both, against the
float64 reference (bounded), with the plain path (``F.linear`` in the input dtype, the rest in
fp32) as the same-dtype baseline; the weight gradient fused into an fp32 ``main_grad`` (bounded);
the delayed weight gradient against the immediate one (bitwise, docs/design.md §2)."""

from __future__ import annotations

import torch

from truefuse.autograd._wgrad import WgradState, run_pending
from truefuse.autograd.linear_log_probs import linear_log_probs
from truefuse.ops.lm_head.linear_log_probs import linear_log_probs_plain, linear_log_probs_ref
from truefuse.testing import bitwise_report, bounded_report
from truefuse.verify.cases_linear_cross_entropy import chunked_tokens, make_inputs
from truefuse.verify.registry import register


def _upstream(t, seed=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t.shape, generator=g, dtype=torch.float64), torch.randn(t.shape, generator=g, dtype=torch.float64)


def run_log_probs(fn, x, W, t, b=None, *, upstream, main_grad=None, **kw):
    """Outputs and gradients of ``fn`` (the op, its reference or the plain path) as a dict;
    ``upstream``: (a, c), the gradients of the log-probs and of the entropies."""
    leaves = {"input": x.detach().clone().requires_grad_(), "linear_weight": W.detach().clone().requires_grad_()}
    if b is not None:
        leaves["linear_bias"] = b.detach().clone().requires_grad_()
    if main_grad is not None:
        leaves["linear_weight"].main_grad = main_grad.clone()
    out = fn(leaves["input"], leaves["linear_weight"], t.to(x.device), linear_bias=leaves.get("linear_bias"), **kw)
    a, c = (u.to(x.device, out.log_probs.dtype) for u in upstream)
    gs = torch.autograd.grad((out.log_probs * a + out.entropy * c).sum(), list(leaves.values()))
    res = {"log_probs": out.log_probs.detach(), "entropy": out.entropy.detach()}
    res.update({f"d{k}": g for k, g in zip(leaves, gs, strict=True)})
    return res


def check_log_probs(x, W, t, b=None, **kw):
    """Bounded reports for both outputs and every gradient."""
    up = _upstream(t)
    got = run_log_probs(linear_log_probs, x, W, t, b, upstream=up, **kw)
    base = run_log_probs(linear_log_probs_plain, x, W, t, b, upstream=up, **kw)
    x64, W64 = x.cpu().double(), W.cpu().double()
    ref = run_log_probs(linear_log_probs_ref, x64, W64, t.cpu(), None if b is None else b.cpu().double(), upstream=up, **kw)
    return {k: bounded_report(got[k], ref[k], base[k]) for k in got}


_CASES = {
    "plain": {},
    "temperature": {"temperature": 0.7},
    "softcap": {"softcap": 4.0},
    "bias": {"bias": True},
    "everything": {"temperature": 1.3, "softcap": 3.0, "bias": True},
    # a −inf bias on a third of the vocabulary (banned or padded tokens): finite entropies
    # (0·log 0 = 0) and gradients; the softcap makes them finite logits (−softcap)
    "masked": {"temperature": 0.7, "bias": "masked"},
    "masked_softcap": {"temperature": 0.7, "softcap": 4.0, "bias": "masked"},
}


def _case(dtype, spec):
    def case(device):
        spec_ = dict(spec)
        bias = spec_.pop("bias", False)
        x, W, t, b = make_inputs(dtype, device, N=chunked_tokens(device), bias=bool(bias))
        if bias == "masked":
            b[1::3] = float("-inf")
            # no target on a masked token (its log-prob is −inf: the relative error needs finite ones)
            t = torch.where((t >= 0) & (t % 3 == 1), t - 1, t)
        return check_log_probs(x, W, t, b, chunk_size=16, **spec_)

    return case


for _dn, _dt in {"bf16": torch.bfloat16, "fp32": torch.float32}.items():
    for _name, _spec in _CASES.items():
        register("linear_log_probs", f"{_name}_{_dn}", "bounded")(_case(_dt, _spec))


def _fused_main_grad(dtype):
    """d_weight added into an fp32 main_grad (starting at 0) against the float64 reference."""

    def case(device):
        x, W, t, _ = make_inputs(dtype, device, N=chunked_tokens(device))
        up = _upstream(t)
        reports = {}
        for chunk in (None, 16):
            Wl = W.clone().requires_grad_()
            Wl.main_grad = torch.zeros(W.shape, device=device)
            out = linear_log_probs(x, Wl, t, chunk_size=chunk, fuse_wgrad_accumulation=True)
            a, c = (u.to(device, out.log_probs.dtype) for u in up)
            (out.log_probs * a + out.entropy * c).sum().backward()
            base = run_log_probs(linear_log_probs_plain, x, W, t, upstream=up)
            ref = run_log_probs(linear_log_probs_ref, x.cpu().double(), W.cpu().double(), t.cpu(), upstream=up)
            reports[f"main_grad_chunk{chunk or 'all'}"] = bounded_report(
                Wl.main_grad, ref["dlinear_weight"], base["dlinear_weight"]
            )
        return reports

    return case


def _delayed_vs_immediate(dtype):
    """A delayed weight gradient (run by ``backward_dw()``) gives the immediate bits."""

    def case(device):
        x, W, t, _ = make_inputs(dtype, device, N=chunked_tokens(device))
        up = _upstream(t)
        reports = {}
        for fused in (False, True):
            for chunk in (None, 16):
                got = {}
                for delay in (False, True):
                    state = WgradState(fuse_wgrad_accumulation=fused, delay_wgrad_compute=delay)
                    Wl = W.clone().requires_grad_()
                    if fused:
                        Wl.main_grad = torch.zeros(W.shape, device=device)
                    out = linear_log_probs(x, Wl, t, chunk_size=chunk, wgrad_state=state)
                    a, c = (u.to(device, out.log_probs.dtype) for u in up)
                    (out.log_probs * a + out.entropy * c).sum().backward()
                    with torch.no_grad():
                        run_pending(state)
                    got[delay] = Wl.main_grad if fused else Wl.grad
                tag = f"{'main_grad' if fused else 'grad'}_chunk{chunk or 'all'}"
                reports[tag] = bitwise_report(got[True], got[False])
        return reports

    return case


for _dn, _dt in {"bf16": torch.bfloat16, "fp32": torch.float32}.items():
    register("linear_log_probs", f"fused_main_grad_{_dn}", "bounded")(_fused_main_grad(_dt))
    register("linear_log_probs", f"delayed_vs_immediate_{_dn}", "bitwise")(_delayed_vs_immediate(_dt))
