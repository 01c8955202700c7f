"""``truefuse.optim.AdamW``: torch's AdamW, one Triton launch per param group and device/dtype
group, bitwise ``torch.optim.AdamW(..., foreach=False, capturable=True)`` on CUDA (docs/optim.md).

A room of its own beside ``nn/`` (docs/design.md §5): like a module it is a user-facing object
over ``ops/`` (here ``ops/adamw.py``'s ``adamw_``), and like ``torch.optim`` it is not a module.
"""

from __future__ import annotations

import torch

from truefuse.ops.adamw import adamw_, check_lr_tensor

_NAME = "truefuse.optim.AdamW"


def _refuse(flag: str, value, why: str) -> None:
    raise ValueError(f"{_NAME} does not support {flag}={value!r}: {why}")


class AdamW(torch.optim.Optimizer):
    """AdamW with torch's signature and state, capturable (its step counts are tensors on each
    parameter's device: no host sync, a CUDA graph can capture ``step()``).

    Bitwise equal to ``torch.optim.AdamW(params, ..., foreach=False, capturable=True)`` on CUDA, for
    fp32, bf16 and fp16 parameters; on the CPU (fp32, Triton's interpreter) equal to the same ops
    with correctly rounded square roots (torch's CPU ``sqrt`` is MKL's; ``ops/adamw.py::sqrt_rn``).

    Args:
        params, lr, betas, eps, weight_decay: as torch's; ``lr`` a float or a one-element fp32
            tensor (put it on the device to change it between replays of a captured step),
            ``betas`` two floats.
        amsgrad, maximize, differentiable: only False (refused by name otherwise).
        capturable: only True: the step count always lives on the device; torch's
            ``capturable=False`` computes the bias corrections on the host in fp64, other bits.
        foreach, fused: accepted for drop-in use and ignored: every group is one launch.
        master_weights: keep an fp32 copy of each bf16/fp16 parameter in its state (``"master"``),
            step it in fp32 (fp32 moments) and write the parameter as its rounding: torch's AdamW on
            the fp32 copy, then ``param.copy_(master)``.

    Gradients: a parameter's ``main_grad`` (an fp32 tensor of its shape, Megatron's convention)
    when it has one, else its ``.grad``; a parameter with neither is skipped (its step count stays).
    ``zero_grad()`` also zeroes every ``main_grad`` in place (its address stays: a captured step
    keeps reading it).
    """

    def __init__(
        self,
        params,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = True,
        differentiable: bool = False,
        fused: bool | None = None,
        master_weights: bool = False,
    ):
        for flag, value in (("amsgrad", amsgrad), ("maximize", maximize), ("differentiable", differentiable)):
            if value:
                _refuse(flag, value, "only AdamW's plain update is fused (use torch.optim.AdamW)")
        if not capturable:
            _refuse("capturable", capturable, "its step counts always live on the device (torch's capturable=True bits)")
        check_lr_tensor(lr, _NAME)
        if not isinstance(lr, torch.Tensor) and not 0.0 <= lr:
            raise ValueError(f"{_NAME}: invalid learning rate lr={lr}")
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(type(b) in (float, int) for b in betas)):
            raise TypeError(f"{_NAME}: betas must be two floats, got {betas!r}")
        for i, b in enumerate(betas):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"{_NAME}: invalid beta parameter at index {i}: betas[{i}]={b}")
        if not 0.0 <= eps:
            raise ValueError(f"{_NAME}: invalid epsilon value eps={eps}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"{_NAME}: invalid weight_decay value weight_decay={weight_decay}")
        defaults = dict(
            lr=lr, betas=tuple(float(b) for b in betas), eps=eps, weight_decay=weight_decay, amsgrad=False,
            maximize=False, foreach=foreach, capturable=True, differentiable=False, fused=None,
            master_weights=master_weights,
        )  # fmt: skip
        super().__init__(params, defaults)

    def _gradient(self, p: torch.Tensor) -> torch.Tensor | None:
        """``p.main_grad`` (checked) when present, else ``p.grad``."""
        mg = getattr(p, "main_grad", None)
        if mg is None:
            return p.grad
        if not isinstance(mg, torch.Tensor) or mg.dtype != torch.float32:
            raise TypeError(f"{_NAME}: a parameter's main_grad must be an fp32 tensor, got {getattr(mg, 'dtype', type(mg))}")
        if mg.shape != p.shape or mg.device != p.device:
            raise ValueError(
                f"{_NAME}: main_grad {tuple(mg.shape)} on {mg.device} for a parameter {tuple(p.shape)} on {p.device}"
            )
        return mg

    def _init_group(self, group):
        params, grads, exp_avgs, exp_avg_sqs, steps, masters = [], [], [], [], [], []
        for p in group["params"]:
            grad = self._gradient(p)
            if grad is None:
                continue
            state = self.state[p]
            if not state:
                master = group["master_weights"] and p.dtype in (torch.bfloat16, torch.float16)
                like = p.detach().to(torch.float32, copy=True) if master else p
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(like, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(like, memory_format=torch.preserve_format)
                if master:
                    state["master"] = like
            params.append(p)
            grads.append(grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
            masters.append(state.get("master"))
        return params, grads, exp_avgs, exp_avg_sqs, steps, masters

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step over every parameter with a gradient (``main_grad`` first)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, steps, masters = self._init_group(group)
            if params:
                adamw_(params, grads, exp_avgs, exp_avg_sqs, steps, lr=group["lr"], betas=group["betas"],
                       eps=group["eps"], weight_decay=group["weight_decay"],
                       masters=masters if any(m is not None for m in masters) else None)  # fmt: skip
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's ``zero_grad``, and every parameter's ``main_grad`` zeroed in place."""
        super().zero_grad(set_to_none)
        mains = [p.main_grad for g in self.param_groups for p in g["params"] if getattr(p, "main_grad", None) is not None]
        if mains:
            torch._foreach_zero_(mains)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, but a master-weight state keeps its fp32 tensors: torch's loader casts every
        floating state to its parameter's dtype, which would round the master and its moments."""
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        mine = [p for g in self.param_groups for p in g["params"]]
        kept = {p: state_dict["state"][i] for i, p in zip(ids, mine, strict=False) if "master" in state_dict["state"].get(i, {})}
        super().load_state_dict(state_dict)
        for p, saved in kept.items():
            for k, v in saved.items():
                if isinstance(v, torch.Tensor):
                    self.state[p][k] = v.to(device=p.device, dtype=torch.float32, copy=True)
