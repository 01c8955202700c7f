"""Contract cases of the fused AdamW step (bitwise, docs/optim.md): three steps of ``adamw_`` over
tensors of odd sizes (one element, a masked tail, several chunks) equal ``adamw_ref`` bit for bit
on the same device: parameters, both moments, step counts and master copies. On CUDA also the
whole optimizer against ``torch.optim.AdamW(..., foreach=False, capturable=True)`` itself (on the
CPU torch refuses ``capturable``; tests/test_adamw.py checks its code there with its ``sqrt`` made
correctly rounded)."""

from __future__ import annotations

import torch

from truefuse.ops.adamw import adamw_, adamw_ref
from truefuse.testing import bitwise_report
from truefuse.verify.registry import register

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: one element, odd sizes, a 2-D tensor, several blocks and chunks (CPU: 128-element chunks) with a tail
SIZES = ((1,), (7,), (33, 5), (1000,), (4097,))
#: name -> (lr, lr as a tensor, weight_decay, betas): the kernel's branches (decay or not; lerp's
#: two forms and addcmul's value 1 with beta1 = 0.3, beta2 = 0)
VARIANTS = {
    "": (1e-2, False, 0.1, (0.9, 0.999)),
    "_no_weight_decay": (1e-2, False, 0.0, (0.9, 0.999)),
    "_lr_tensor": (3e-3, True, 0.05, (0.9, 0.95)),
    "_lerp_second_form": (1e-2, False, 0.1, (0.3, 0.0)),
}


def _tensors(device, dtype, master: bool):
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=g).to(device, dtype) for s in SIZES]
    masters = [p.float() for p in params] if master else None
    like = masters or params
    zeros = lambda: [torch.zeros_like(x) for x in like]  # noqa: E731
    return [params, zeros(), zeros(), [torch.zeros((), device=device) for _ in params], masters]


def _grads(device, dtype, step: int):
    g = torch.Generator().manual_seed(100 + step)
    return [(0.1 * torch.randn(s, generator=g)).to(device, dtype) for s in SIZES]


def _flat(ts):
    return torch.cat([t.reshape(-1) for t in ts])


def _case(dtype, variant: str, *, master: bool = False, grad_dtype=None):
    lr, lr_tensor, wd, betas = VARIANTS[variant]

    def case(device):
        lr_ = torch.tensor(lr, device=device) if lr_tensor else lr
        ours, ref = _tensors(device, dtype, master), _tensors(device, dtype, master)
        for step in range(3):
            grads = _grads(device, grad_dtype or dtype, step)
            p, m, v, s, w = ours
            adamw_(p, grads, m, v, s, lr=lr_, betas=betas, eps=1e-8, weight_decay=wd, masters=w)
            p, m, v, s, w = ref
            adamw_ref(p, grads, m, v, s, lr=lr_, beta1=betas[0], beta2=betas[1], eps=1e-8, weight_decay=wd, masters=w)
        names = ("params", "exp_avg", "exp_avg_sq", "step", "master")
        return {n: bitwise_report(_flat(a), _flat(b)) for n, a, b in zip(names, ours, ref, strict=True) if a is not None}

    return case


def _torch_case(dtype):
    """truefuse.optim.AdamW against torch.optim.AdamW(foreach=False, capturable=True), 3 steps."""

    def case(device):
        from truefuse.optim import AdamW

        params = {k: _tensors(device, dtype, False)[0] for k in ("ours", "torch")}
        lr = torch.tensor(3e-3, device=device)
        opts = {"ours": AdamW(params["ours"], lr=lr, weight_decay=0.1),
                "torch": torch.optim.AdamW(params["torch"], lr=lr, weight_decay=0.1, foreach=False, capturable=True)}  # fmt: skip
        for step in range(3):
            for k, opt in opts.items():
                for p, g in zip(params[k], _grads(device, dtype, step), strict=True):
                    p.grad = g
                opt.step()
        return {"params": bitwise_report(_flat(params["ours"]), _flat(params["torch"]))}

    return case


for _dn, _dt in _DTYPES.items():
    _where = ("cpu", "cuda") if _dt == torch.float32 else ("cuda",)  # the CPU runs bf16/fp16 as adamw_ref itself
    for _v in VARIANTS:
        register("adamw", f"{_dn}{_v}", "bitwise", devices=_where)(_case(_dt, _v))
    register("adamw", f"torch_capturable_{_dn}", "bitwise", devices=("cuda",))(_torch_case(_dt))
for _dn in ("bf16", "fp16"):
    _dt = _DTYPES[_dn]
    # fp16 with masters runs the kernel under the CPU interpreter too (ops/adamw.py::_kernel_runs)
    _where = ("cpu", "cuda") if _dt == torch.float16 else ("cuda",)
    register("adamw", f"{_dn}_master", "bitwise", devices=_where)(_case(_dt, "", master=True))
    register("adamw", f"{_dn}_master_main_grad", "bitwise", devices=_where)(_case(_dt, "", master=True, grad_dtype=torch.float32))
    register("adamw", f"{_dn}_main_grad", "bitwise", devices=("cuda",))(_case(_dt, "", grad_dtype=torch.float32))
