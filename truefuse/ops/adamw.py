"""AdamW's update: ``adamw_ref`` (torch's single-tensor capturable AdamW, op by op) and ``adamw_``,
one Triton launch for a group of tensors of one device and dtype (``kernels/adamw.py``), bitwise
``adamw_ref`` on the same device (docs/optim.md). ``truefuse.optim.AdamW`` calls it per param group.

The launch reads a table of addresses and sizes, uploaded once per set of addresses and kept
(``_tables``): a CUDA graph replays the launch with the table it captured, so a table a capture
used (and the host copy its upload reads at each replay) is kept for the life of the process.
"""

from __future__ import annotations

import struct
from collections import OrderedDict

import torch

from truefuse.config import get_config
from truefuse.ops._launch.capture import capturing
from truefuse.ops._launch.custom_op import custom_op, launch
from truefuse.ops._launch.dtensor import refuse_dtensor
from truefuse.ops._launch.triton import triton_runs

_OP = "ops.adamw_"
_LOW = (torch.bfloat16, torch.float16)


def sqrt_rn(t: torch.Tensor) -> torch.Tensor:
    """``t.sqrt()`` correctly rounded (IEEE, in fp32 for bf16/fp16, then rounded to ``t``'s dtype),
    as CUDA's ``sqrt`` is. The CPU's fp32 ``sqrt`` is MKL's ``vsSqrt`` (within 1 ulp, not correctly
    rounded: 674 of 100003 random values were 1 ulp off, torch 2.13; a 0-dim tensor too), so there
    it is taken in fp64 and rounded, which is exact (fp64 carries a float's square root to more
    than twice fp32's precision). fp64 keeps its own ``sqrt`` (no kernel runs in fp64)."""
    if t.is_cuda or t.dtype == torch.float64:
        return torch.sqrt(t)
    return torch.sqrt(t.double()).float().to(t.dtype)


def adamw_ref(params, grads, exp_avgs, exp_avg_sqs, steps, *, lr, beta1, beta2, eps, weight_decay, masters=None,
              sqrt=sqrt_rn) -> None:  # fmt: skip
    """One AdamW step in place, as ``torch.optim.AdamW(..., foreach=False, capturable=True)``
    computes it (``torch/optim/adam.py::_single_tensor_adam``, its ``capturable`` branch): the same
    ops in the same order, each rounded to its tensor's dtype. What :func:`adamw_` must equal bit
    for bit. Its square roots are :func:`sqrt_rn`: torch's own on CUDA; on the CPU torch's are
    MKL's, which no kernel reproduces (``sqrt=torch.sqrt`` gives torch's CPU AdamW bits:
    tests/test_adamw.py checks both).

    Two cases torch's AdamW has no path for, written as its ops would compute them: with
    ``masters``, the fp32 master copy is stepped (its gradient the fp32 upcast) and the parameter
    receives its rounding, which is torch's AdamW on the master followed by ``param.copy_``; an
    fp32 gradient (``main_grad``) with bf16 states, where ``lerp_`` wants one dtype, lerps in fp32
    and rounds once (the opmath of torch's bf16 ``lerp_``).
    """
    for i, param in enumerate(params):
        master = masters[i] if masters else None
        target = param if master is None else master
        grad = grads[i] if master is None else grads[i].to(torch.float32)
        exp_avg, exp_avg_sq, step_t = exp_avgs[i], exp_avg_sqs[i], steps[i]
        step_t += 1
        if weight_decay != 0:
            target.mul_(1 - lr * weight_decay)
        if grad.dtype == exp_avg.dtype:
            exp_avg.lerp_(grad, 1 - beta1)
        else:
            exp_avg.copy_(exp_avg.float().lerp_(grad, 1 - beta1))
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1**step_t
        bias_correction2 = 1 - beta2**step_t
        step_size = lr / bias_correction1
        step_size_neg = step_size.neg()
        bias_correction2_sqrt = sqrt(bias_correction2)
        denom = (sqrt(exp_avg_sq) / (bias_correction2_sqrt * step_size_neg)).add_(eps / step_size_neg)
        target.addcdiv_(exp_avg, denom)
        if master is not None:
            param.copy_(master)


def _fp32(x: float) -> float:
    """``x`` rounded to fp32 (what torch's kernels make of a Python scalar), as a Python float."""
    return struct.unpack("f", struct.pack("f", x))[0]


def device_scalars(steps, lr, beta1, beta2, eps, weight_decay, store_dtype: torch.dtype) -> torch.Tensor:
    """Per tensor, (weight-decay factor, A, D) as ``adamw_ref``'s elementwise ops see them on the
    steps' device: fp32 ``(T, 3)``. A and D are torch's own expressions on the (already advanced)
    step (``kernels/adamw.py``'s module doc), the factor ``1 - lr * weight_decay``.

    On CUDA the expressions run once over the stacked steps: a CUDA elementwise op gives each
    element the bits it gives that element's 0-dim tensor (the same device function per element).
    On the CPU they run per tensor, as ``adamw_ref`` does: the CPU's ``pow`` is vectorised (Sleef)
    over a vector and scalar (``std::pow``) on a 0-dim tensor, and 28 of 3000 steps of
    ``0.9 ** step`` differed between the two (torch 2.13).

    A 0-dim CUDA tensor entering an op on a bf16/fp16 tensor is cast to that dtype first (the
    kernel loads its operands in the op's dtype), so A and D, and the factor when ``lr`` is a tensor
    on the steps' device, are rounded through ``store_dtype`` there; a Python scalar or a CPU 0-dim
    tensor is read in fp32 (``iter.scalar_value<opmath_t>``).
    """

    def denominators(step):
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr / bias_correction1
        step_size_neg = step_size.neg()
        bias_correction2_sqrt = sqrt_rn(bias_correction2)
        return bias_correction2_sqrt * step_size_neg, eps / step_size_neg

    device, n = steps[0].device, len(steps)
    if device.type == "cuda":
        a, d = denominators(torch.stack(steps))
    else:
        pairs = [denominators(s) for s in steps]
        a, d = torch.stack([x for x, _ in pairs]), torch.stack([y for _, y in pairs])
    if weight_decay == 0:
        wdf = torch.ones(n, device=device)
    elif isinstance(lr, torch.Tensor):
        factor = (1 - lr * weight_decay).reshape(())
        if factor.device == device and store_dtype in _LOW:
            factor = factor.to(store_dtype)
        wdf = factor.to(device=device, dtype=torch.float32, non_blocking=True).expand(n)
    else:
        wdf = torch.full((n,), _fp32(1 - lr * weight_decay), device=device)
    if store_dtype in _LOW:
        a, d = a.to(store_dtype), d.to(store_dtype)
    return torch.stack([wdf, a.float(), d.float()], dim=1)


def check_lr_tensor(lr, who: str) -> None:
    """A learning rate given as a tensor must hold one fp32 element (read on the device each step)."""
    if isinstance(lr, torch.Tensor) and (lr.numel() != 1 or lr.dtype != torch.float32):
        raise ValueError(f"{who}: lr as a tensor must have one fp32 element, got {tuple(lr.shape)} {lr.dtype}")


def _check(params, grads, exp_avgs, exp_avg_sqs, steps, masters, lr) -> None:
    """Every argument before any launch (docs/design.md §6.9): one error naming the argument."""
    n = len(params)
    for name, xs in (("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs), ("steps", steps)):
        if len(xs) != n:
            raise ValueError(f"truefuse.{_OP}: {name} has {len(xs)} tensors for {n} params")
    if masters is not None and len(masters) != n:
        raise ValueError(f"truefuse.{_OP}: masters has {len(masters)} entries for {n} params")
    check_lr_tensor(lr, f"truefuse.{_OP}")
    for i, p in enumerate(params):
        g, m, v, s = grads[i], exp_avgs[i], exp_avg_sqs[i], steps[i]
        w = masters[i] if masters is not None else None
        refuse_dtensor(_OP, **{f"params[{i}]": p, f"grads[{i}]": g, f"exp_avgs[{i}]": m, f"exp_avg_sqs[{i}]": v})
        if p.is_complex() or not p.is_floating_point():
            raise TypeError(f"truefuse.{_OP}: params[{i}] is {p.dtype}; AdamW here takes real floating-point parameters")
        if g.is_sparse:
            raise RuntimeError(f"truefuse.{_OP}: grads[{i}] is sparse; AdamW does not support sparse gradients")
        if g.dtype not in (p.dtype, torch.float32):
            raise TypeError(f"truefuse.{_OP}: grads[{i}] is {g.dtype}; it must be the parameter's {p.dtype} or fp32")
        state = torch.float32 if w is not None else p.dtype
        if w is not None and (w.dtype != torch.float32 or w.shape != p.shape or w.device != p.device):
            raise ValueError(f"truefuse.{_OP}: masters[{i}] must be an fp32 tensor of params[{i}]'s shape and device")
        for name, t, dtype in ((f"grads[{i}]", g, g.dtype), (f"exp_avgs[{i}]", m, state), (f"exp_avg_sqs[{i}]", v, state)):
            if t.shape != p.shape or t.device != p.device or t.dtype != dtype:
                raise ValueError(
                    f"truefuse.{_OP}: {name} is {t.dtype} {tuple(t.shape)} on {t.device}; params[{i}] is "
                    f"{p.dtype} {tuple(p.shape)} on {p.device} (states {dtype})"
                )
        if s.dim() != 0 or s.dtype != torch.float32 or s.device != p.device:
            raise ValueError(
                f"truefuse.{_OP}: steps[{i}] must be a 0-dim fp32 tensor on params[{i}]'s device, "
                f"got {s.dtype} {tuple(s.shape)} on {s.device}"
            )


def adamw_(params, grads, exp_avgs, exp_avg_sqs, steps, *, lr, betas, eps, weight_decay, masters=None) -> None:
    """One AdamW step in place over lists of tensors, bitwise :func:`adamw_ref` on their device.

    Args:
        params: the parameters (fp32, bf16 or fp16; fp64 and the CPU's bf16 run ``adamw_ref``).
        grads: each parameter's gradient, its dtype or fp32 (a Megatron ``main_grad``).
        exp_avgs, exp_avg_sqs: the moment estimates, in the parameter's dtype, or fp32 with a master.
        steps: 0-dim fp32 step counts on each parameter's device, advanced by one here.
        lr: a float or a one-element fp32 tensor (on the device: a CUDA graph replays its value).
        betas: two floats; ``eps``, ``weight_decay``: floats.
        masters: None, or per parameter an fp32 master copy (None for a parameter without one): the
            master is stepped and the parameter receives its rounding.

    The tensors are launched in groups of one device and dtypes, one kernel each
    (``truefuse::adamw_``; docs/design.md §6.7).
    """
    _check(params, grads, exp_avgs, exp_avg_sqs, steps, masters, lr)
    if isinstance(lr, torch.Tensor) and lr.dim():
        lr = lr.reshape(())  # torch's _to_scalar: a one-element tensor acts as a 0-dim one
    beta1, beta2 = betas
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        w = masters[i] if masters is not None else None
        # a 0-dim bf16/fp16 parameter: apart, its group runs adamw_ref (_kernel_runs)
        scalar = p.dim() == 0 and w is None and p.dtype in _LOW
        groups.setdefault((p.device, p.dtype, grads[i].dtype, w is not None, scalar), []).append(i)
    lr_tensor = lr if isinstance(lr, torch.Tensor) else None
    lr_float = 0.0 if lr_tensor is not None else float(lr)
    for (_, _, _, has_master, _), idx in groups.items():
        params_, grads_, exp_avgs_, exp_avg_sqs_, steps_ = (
            [xs[i] for i in idx] for xs in (params, grads, exp_avgs, exp_avg_sqs, steps)
        )
        launch(
            adamw_op,
            params_,
            grads_,
            exp_avgs_,
            exp_avg_sqs_,
            [masters[i] for i in idx] if has_master else [],
            steps_,
            lr_float,
            lr_tensor,
            float(beta1),
            float(beta2),
            float(eps),
            float(weight_decay),
        )


def _kernel_runs(params, state_dtype: torch.dtype, master: bool) -> bool:
    """Whether the kernel takes the group: ``triton_runs``, and fp16 parameters with fp32 masters
    under the CPU interpreter (every op then runs in fp32 and the parameter's one cast is numpy's
    float16, correctly rounded; the interpreter's bf16 cast truncates): the master path's kernel
    is tested on the CPU. Not a 0-dim bf16/fp16 parameter without a master: there torch's ops
    meet 0-dim fp32 scalars as equals (fp32 results, not rounded to the parameter's dtype between
    ops), which the kernel's rounding rule (``device_scalars``) does not describe."""
    p = params[0]
    if state_dtype in _LOW and any(q.dim() == 0 for q in params):
        return False
    if triton_runs(p):
        return True
    return master and p.dtype == torch.float16 and p.device.type == "cpu" and get_config().triton_interpret


@custom_op("truefuse::adamw_", mutates_args=("params", "exp_avgs", "exp_avg_sqs", "masters", "steps"))
def adamw_op(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    masters: list[torch.Tensor],
    steps: list[torch.Tensor],
    lr: float,
    lr_tensor: torch.Tensor | None,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """:func:`adamw_` on one group of one device and dtypes (``masters`` empty or one per
    parameter; ``lr_tensor``, when given, replaces ``lr``): one launch, or ``adamw_ref``."""
    if not params:
        return
    lr_ = lr_tensor if lr_tensor is not None else lr
    tensors = [*params, *grads, *exp_avgs, *exp_avg_sqs, *masters]
    if not (_kernel_runs(params, exp_avgs[0].dtype, bool(masters)) and all(t.is_contiguous() for t in tensors)):
        # fp64, the CPU's bf16 (the interpreter truncates its casts), a strided tensor: torch's ops
        adamw_ref(params, grads, exp_avgs, exp_avg_sqs, steps, lr=lr_, beta1=beta1, beta2=beta2, eps=eps,
                  weight_decay=weight_decay, masters=masters or None)  # fmt: skip
        return
    from truefuse.kernels.adamw import _adamw_kernel

    torch._foreach_add_(steps, 1)
    scalars = device_scalars(steps, lr_, beta1, beta2, eps, weight_decay, exp_avgs[0].dtype)
    cuda = params[0].is_cuda
    block, chunk, warps = (1024, 16384, 4) if cuda else (64, 128, 1)
    table, chunks, aligned = _tables(params, grads, exp_avgs, exp_avg_sqs, masters, chunk)
    if chunks.numel() == 0:  # every tensor empty
        return
    w1, c2 = _fp32(1 - beta1), _fp32(1 - beta2)
    _adamw_kernel[(chunks.shape[0] // 2,)](
        table, chunks, scalars, params[0], grads[0], exp_avgs[0], w1, _fp32(beta2), c2,
        MASTER=bool(masters), HAS_WD=weight_decay != 0, LERP_SMALL=abs(w1) < 0.5,
        # torch's addcmul (kernels/adamw.py): CUDA's fma(c, g*g, v), or fma(g, g, v) for c == 1; the CPU's fma(c*g, g, v)
        SQ_FORM=1 if cuda and c2 != 1.0 else 0,
        ALIGNED=aligned, BLOCK=block, CHUNK=chunk, num_warps=warps, enable_fp_fusion=False,
    )  # fmt: skip


@adamw_op.register_fake
def _(params, grads, exp_avgs, exp_avg_sqs, masters, steps, lr, lr_tensor, beta1, beta2, eps, weight_decay):
    return None


#: (device, chunk, addresses and sizes) -> (host table, device table, device chunks, aligned), least recently used last
_TABLES: OrderedDict[tuple, tuple] = OrderedDict()
_KEEP = 8
#: the tables CUDA graphs captured: their replays read them (and the host copy) again
_CAPTURED: dict[tuple, tuple] = {}


def _tables(params, grads, exp_avgs, exp_avg_sqs, masters, chunk: int):
    """The kernel's address table ``(T, 6)`` and chunk table ``(C, 2)`` (flattened), and whether
    every address is 16-byte aligned; built on the host and uploaded once per set of addresses."""
    rows = tuple(
        (p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), masters[i].data_ptr() if masters else 0, p.numel())
        for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, strict=True))
    )
    device = params[0].device
    key = (device, chunk, rows)
    entry = _TABLES.get(key)
    if entry is None:
        host_rows = torch.tensor(rows, dtype=torch.int64)
        numel = host_rows[:, 5]
        counts = (numel + chunk - 1) // chunk
        first = torch.cumsum(counts, 0) - counts
        owner = torch.repeat_interleave(torch.arange(len(rows)), counts)
        starts = (torch.arange(int(counts.sum())) - first[owner]) * chunk
        host = torch.cat([host_rows.flatten(), torch.stack([owner, starts], 1).flatten()])
        if device.type == "cuda":
            # pinned: a capture may record a copy from page-locked memory only (a pageable one fails
            # it, docs/cuda_graphs.md); the graph's copy node then reads `host` at each replay
            host = host.pin_memory()
        dev = host.to(device, non_blocking=True)
        aligned = all(a % 16 == 0 for r in rows for a in r[:5])
        entry = (host, dev[: host_rows.numel()], dev[host_rows.numel() :], aligned)
        _TABLES[key] = entry
        while len(_TABLES) > _KEEP:
            _TABLES.popitem(last=False)
    _TABLES.move_to_end(key)
    if capturing(params[0]):
        _CAPTURED[key] = entry
    return entry[1], entry[2], entry[3]
