"""Contract cases of ``linear_cross_entropy`` (docs/design.md §1): the loss and the gradients of input,
weight and bias against the float64 reference (bounded), with the plain path (``F.linear`` in the
input dtype, cross-entropy in fp32) as the same-dtype baseline; the weight gradient fused into an
fp32 ``main_grad`` (bounded); and the delayed weight gradient against the immediate one (bitwise,
docs/design.md §2), one chunk and several. The same for ``memory="lean"`` under the op name
``linear_cross_entropy_lean`` (``lean_*`` cases; the main_grad case over 4 micro-batches)."""

from __future__ import annotations

import torch

from truefuse.autograd.linear_cross_entropy import linear_cross_entropy
from truefuse.nn.linear_cross_entropy import LinearCrossEntropyLoss
from truefuse.ops.lm_head.linear_cross_entropy import linear_cross_entropy_plain, linear_cross_entropy_ref
from truefuse.testing import bitwise_report, bounded_report
from truefuse.verify.registry import register


def make_inputs(dtype, device, N=53, H=40, V=203, lead=(), ignore="some", bias=False, seed=0):
    """Random (input, weight, target, bias) with tokens shaped ``(*lead, N)``; ``ignore`` is
    ``some`` (every 4th token), ``none`` or ``all``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, N, H, generator=g).to(device, dtype)
    W = (torch.randn(V, H, generator=g) * H**-0.5 * 2).to(device, dtype)
    t = torch.randint(0, V, (*lead, N), generator=g).to(device)
    if ignore == "some":
        t.view(-1)[::4] = -100
    elif ignore == "all":
        t.fill_(-100)
    b = (torch.randn(V, generator=g) * 0.5).to(device, dtype) if bias else None
    return x, W, t, b


def chunked_tokens(device) -> int:
    """Tokens of the cases that run the op at chunk_size=16 (every option; delayed against
    immediate: 8 runs each, unchunked too; main_grad): make_inputs' 53 on a GPU; 21 under the CPU
    interpreter (one program per token), which chunk_size=16 still splits into a whole chunk and a tail."""
    return 53 if torch.device(device).type == "cuda" else 21


#: keywords of the fused op alone (the reference and the plain path do not take them)
FUSED_ONLY = ("memory", "vocab_slice", "fp32_weight_grad")


def check_lce(x, W, t, b=None, *, grads=("input", "linear_weight", "linear_bias"), upstream=None, **kw):
    """Bounded reports for the loss and each asked-for gradient; ``upstream`` is the gradient of
    the loss (default 1, or a random tensor for ``reduction="none"``). Keywords in
    :data:`FUSED_ONLY` go to ``linear_cross_entropy`` only."""
    fused_kw = {k: kw.pop(k) for k in FUSED_ONLY if k in kw}

    def run(fn, xx, WW, bb, **extra):
        leaves = {"input": xx.detach().clone(), "linear_weight": WW.detach().clone()}
        if bb is not None:
            leaves["linear_bias"] = bb.detach().clone()
        for k, v in leaves.items():
            v.requires_grad_(k in grads)
        kw_dev = {k: v.to(xx.device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        loss = fn(
            leaves["input"], leaves["linear_weight"], t.to(xx.device), linear_bias=leaves.get("linear_bias"), **kw_dev, **extra
        )
        up = torch.ones_like(loss) if upstream is None else upstream.to(loss.device, loss.dtype)
        wanted = [v for v in leaves.values() if v.requires_grad]
        gs = torch.autograd.grad(loss, wanted, up) if wanted else []
        return {
            "loss": loss.detach(),
            **{f"d{k}": g for (k, v), g in zip([(k, v) for k, v in leaves.items() if v.requires_grad], gs, strict=True)},
        }

    got = run(linear_cross_entropy, x, W, b, **fused_kw)
    base = run(linear_cross_entropy_plain, x, W, b)
    ref = run(linear_cross_entropy_ref, x.cpu().double(), W.cpu().double(), None if b is None else b.cpu().double())
    return {k: bounded_report(got[k], ref[k], base[k]) for k in got}


_CASES = {
    "mean": {},
    "sum": {"reduction": "sum"},
    "label_smoothing": {"label_smoothing": 0.1},
    "z_loss": {"z_loss": 1e-3},
    "softcap": {"softcap": 4.0},
    "class_weight": {"weight": "w"},
    "bias": {"bias": True},
    "everything": {"label_smoothing": 0.2, "z_loss": 1e-2, "softcap": 3.0, "weight": "w", "bias": True},
}


def _case(dtype, spec):
    def case(device):
        spec_ = dict(spec)
        bias = spec_.pop("bias", False)
        x, W, t, b = make_inputs(dtype, device, N=chunked_tokens(device), bias=bias)
        if spec_.get("weight") == "w":
            spec_["weight"] = torch.rand(W.shape[0], generator=torch.Generator().manual_seed(9)).to(device) + 0.5
        return check_lce(x, W, t, b, chunk_size=16, **spec_)

    return case


for _dn, _dt in {"bf16": torch.bfloat16, "fp32": torch.float32}.items():
    for _name, _spec in _CASES.items():
        register("linear_cross_entropy", f"{_name}_{_dn}", "bounded")(_case(_dt, _spec))


def _fused_main_grad(dtype):
    """d_weight added into an fp32 main_grad (starting at 0) against the float64 reference."""

    def case(device):
        x, W, t, _ = make_inputs(dtype, device, N=chunked_tokens(device))
        reports = {}
        for chunk in (None, 16):
            Wl = W.clone().requires_grad_()
            Wl.main_grad = torch.zeros(W.shape, device=device)
            linear_cross_entropy(x, Wl, t, chunk_size=chunk, fuse_wgrad_accumulation=True).backward()
            base = W.clone().requires_grad_()
            linear_cross_entropy_plain(x, base, t).backward()
            ref = W.cpu().double().requires_grad_()
            linear_cross_entropy_ref(x.cpu().double(), ref, t.cpu()).backward()
            reports[f"main_grad_chunk{chunk or 'all'}"] = bounded_report(Wl.main_grad, ref.grad, base.grad)
        return reports

    return case


def _delayed_vs_immediate(dtype):
    """LinearCrossEntropyLoss(delay_wgrad_compute=True): backward_dw() gives the immediate bits."""

    def case(device):
        x, W, t, _ = make_inputs(dtype, device, N=chunked_tokens(device))
        reports = {}
        for fused in (False, True):
            for chunk in (None, 16):
                got = {}
                for delay in (False, True):
                    m = LinearCrossEntropyLoss(chunk_size=chunk, fuse_wgrad_accumulation=fused, delay_wgrad_compute=delay)
                    Wl = W.clone().requires_grad_()
                    if fused:
                        Wl.main_grad = torch.zeros(W.shape, device=device)
                    m(x, Wl, t).backward()
                    m.backward_dw()
                    got[delay] = Wl.main_grad if fused else Wl.grad
                tag = f"{'main_grad' if fused else 'grad'}_chunk{chunk or 'all'}"
                reports[tag] = bitwise_report(got[True], got[False])
        return reports

    return case


for _dn, _dt in {"bf16": torch.bfloat16, "fp32": torch.float32}.items():
    register("linear_cross_entropy", f"fused_main_grad_{_dn}", "bounded")(_fused_main_grad(_dt))
    register("linear_cross_entropy", f"delayed_vs_immediate_{_dn}", "bitwise")(_delayed_vs_immediate(_dt))


# memory="lean" (vocabulary slices; docs/linear_cross_entropy.md, "Memory"): its own op name, so
# that ``verify --op linear_cross_entropy_lean`` selects them. 64-class slices: 4 of V = 203 (3
# aligned, then the 11 remaining classes).
_LEAN = {"memory": "lean", "vocab_slice": 64}
_LEAN_N = 24  # tokens: the CPU interpreter runs one program per token and slice
_LEAN_CASES = {
    "lean_mean": {},
    "lean_none": {"reduction": "none"},
    "lean_everything": {"label_smoothing": 0.2, "z_loss": 1e-2, "softcap": 3.0, "weight": "w", "bias": True},
}


def _lean_case(dtype, spec):
    def case(device):
        spec_ = dict(spec)
        bias = spec_.pop("bias", False)
        x, W, t, b = make_inputs(dtype, device, N=_LEAN_N, bias=bias)
        if spec_.get("weight") == "w":
            spec_["weight"] = torch.rand(W.shape[0], generator=torch.Generator().manual_seed(9)).to(device) + 0.5
        up = None
        if spec_.get("reduction") == "none":
            up = torch.randn(t.shape, generator=torch.Generator().manual_seed(3))
        return check_lce(x, W, t, b, upstream=up, **_LEAN, **spec_)

    return case


def _lean_main_grad(dtype, steps=4):
    """main_grad (fp32, starting at 0) after ``steps`` micro-batches of lean, against the float64
    sum of the reference's weight gradients; baseline: the plain path's gradient in the weight's
    dtype, added in fp32."""

    def case(device):
        W = make_inputs(dtype, device, N=_LEAN_N)[1]
        Wl = W.clone().requires_grad_()
        Wl.main_grad = torch.zeros(W.shape, device=device)
        base = torch.zeros(W.shape, device=device)
        ref = torch.zeros(W.shape, dtype=torch.float64)
        for step in range(steps):
            x, _, t, _ = make_inputs(dtype, device, N=_LEAN_N, seed=10 + step)
            linear_cross_entropy(x, Wl, t, fuse_wgrad_accumulation=True, **_LEAN).backward()
            Wb = W.clone().requires_grad_()
            linear_cross_entropy_plain(x, Wb, t).backward()
            base += Wb.grad.float()
            Wr = W.cpu().double().requires_grad_()
            linear_cross_entropy_ref(x.cpu().double(), Wr, t.cpu()).backward()
            ref += Wr.grad
        return {f"main_grad_{steps}_steps": bounded_report(Wl.main_grad, ref, base)}

    return case


def _lean_delayed_vs_immediate(dtype):
    """LinearCrossEntropyLoss(memory="lean", delay_wgrad_compute=True): backward_dw() recomputes
    the slices and gives the immediate bits, into .grad and into main_grad, mean and none."""

    def case(device):
        x, W, t, _ = make_inputs(dtype, device, N=_LEAN_N)
        up = torch.randn(t.shape, generator=torch.Generator().manual_seed(3)).to(device, dtype)
        reports = {}
        for fused in (False, True):
            for reduction in ("mean", "none"):
                got = {}
                for delay in (False, True):
                    m = LinearCrossEntropyLoss(
                        reduction=reduction, fuse_wgrad_accumulation=fused, delay_wgrad_compute=delay, **_LEAN
                    )
                    Wl = W.clone().requires_grad_()
                    if fused:
                        Wl.main_grad = torch.zeros(W.shape, device=device)
                    loss = m(x, Wl, t)
                    loss.backward(up if reduction == "none" else None)
                    m.backward_dw()
                    got[delay] = Wl.main_grad if fused else Wl.grad
                reports[f"{'main_grad' if fused else 'grad'}_{reduction}"] = bitwise_report(got[True], got[False])
        return reports

    return case


for _dn, _dt in {"bf16": torch.bfloat16, "fp32": torch.float32}.items():
    for _name, _spec in _LEAN_CASES.items():
        register("linear_cross_entropy_lean", f"{_name}_{_dn}", "bounded")(_lean_case(_dt, _spec))
    register("linear_cross_entropy_lean", f"lean_main_grad_{_dn}", "bounded")(_lean_main_grad(_dt))
    register("linear_cross_entropy_lean", f"lean_delayed_vs_immediate_{_dn}", "bitwise")(_lean_delayed_vs_immediate(_dt))
