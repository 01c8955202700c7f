"""The planned product as ``torch.library`` custom ops (docs/design.md §6.7): the plan is made and
run inside the op, on real tensors (the request reads the operands' alignment), so a traced graph
holds one opaque call per GEMM. ``gemm_op`` allocates its output (a fused grouped call returns its
own); ``gemm_result_op`` is its common call without the optional outputs; ``gemm_out_op`` writes or
accumulates into a given one. They write the optional pre-activation and bias-gradient outputs.
Not differentiable: the autograd Functions call them on tensors that need no gradient. Called
after ``gemm_checks.validate``; only the output's aliasing is checked here, where storages have
addresses.
"""

from __future__ import annotations

import torch

from truefuse.ops._launch.custom_op import custom_op
from truefuse.ops.gemm.gemm_checks import check_out_not_aliased
from truefuse.ops.gemm.gemm_exec import GemmArgs, run
from truefuse.ops.gemm.gemm_plan import plan, request


def _execute(
    a, b, out, odt, accumulate, bias, activation, pre_out, grad_activation, pre_activation, gb_out, splits, per_group, bi
):
    grouped = splits is not None
    if out is not None:
        check_out_not_aliased(out, a=a, b=b, bias=bias, pre_activation=pre_activation)
    req = request(a, b, odt, accumulate, bias, activation, grad_activation, gb_out is not None, grouped, per_group, bi)
    chosen = plan(req)
    rows_mode = b.dim() == 3
    if out is None and "grouped" not in chosen.fused:  # a fused grouped call allocates its own
        out = torch.empty(_out_shape(a, b, splits), dtype=odt, device=a.device)
    args = GemmArgs(a, b, out, odt, bool(accumulate), bias, activation, pre_out, grad_activation, pre_activation, gb_out)
    return run(chosen, args, splits, rows_mode)


def _out_shape(a, b, splits) -> tuple[int, ...]:
    if splits is not None and b.dim() == 2:
        return (len(splits), a.shape[0], b.shape[-1])
    return (a.shape[0], b.shape[-1])


@custom_op("truefuse::gemm", mutates_args=("pre_out", "grad_bias_out"))
def gemm_op(
    a: torch.Tensor,
    b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    activation: str | None,
    pre_out: torch.Tensor | None,
    grad_activation: str | None,
    pre_activation: torch.Tensor | None,
    grad_bias_out: torch.Tensor | None,
    splits: list[int] | None,
    per_group: bool,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """The validated ``gemm`` without ``out=``: planned and run here; returns the new output."""
    return _execute(
        a,
        b,
        None,
        out_dtype,
        False,
        bias,
        activation,
        pre_out,
        grad_activation,
        pre_activation,
        grad_bias_out,
        splits,
        per_group,
        batch_invariant,
    )


@gemm_op.register_fake
def _(
    a,
    b,
    out_dtype,
    bias,
    activation,
    pre_out,
    grad_activation,
    pre_activation,
    grad_bias_out,
    splits,
    per_group,
    batch_invariant=False,
):
    return a.new_empty(_out_shape(a, b, splits), dtype=out_dtype)


# The common call (no pre-activation, no bias gradient) as an op that mutates nothing: traced, the
# mutating ``gemm_op`` with both its mutable arguments None became an auto_functionalized call that
# Inductor (torch 2.13) lowered to the op plus a ``getitem`` of its single tensor, and failed
# ("<built-in function getitem> is not an OpOverload"): every F.linear of a batch-invariant model
# under compile_layers (tests/hf/test_compile_layers.py).
@custom_op("truefuse::gemm_result", mutates_args=())
def gemm_result_op(
    a: torch.Tensor,
    b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    activation: str | None,
    grad_activation: str | None,
    pre_activation: torch.Tensor | None,
    splits: list[int] | None,
    per_group: bool,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """``gemm_op`` without the optional outputs: returns the new output."""
    return _execute(
        a,
        b,
        None,
        out_dtype,
        False,
        bias,
        activation,
        None,
        grad_activation,
        pre_activation,
        None,
        splits,
        per_group,
        batch_invariant,
    )


@gemm_result_op.register_fake
def _(a, b, out_dtype, bias, activation, grad_activation, pre_activation, splits, per_group, batch_invariant=False):
    return a.new_empty(_out_shape(a, b, splits), dtype=out_dtype)


@custom_op("truefuse::gemm_out", mutates_args=("out", "pre_out", "grad_bias_out"))
def gemm_out_op(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    accumulate: bool,
    bias: torch.Tensor | None,
    activation: str | None,
    pre_out: torch.Tensor | None,
    grad_activation: str | None,
    pre_activation: torch.Tensor | None,
    grad_bias_out: torch.Tensor | None,
    splits: list[int] | None,
    per_group: bool,
    batch_invariant: bool = False,
) -> None:
    """The validated ``gemm`` with ``out=``: planned and run here, written (or added) into ``out``."""
    _execute(
        a,
        b,
        out,
        out.dtype,
        accumulate,
        bias,
        activation,
        pre_out,
        grad_activation,
        pre_activation,
        grad_bias_out,
        splits,
        per_group,
        batch_invariant,
    )


@gemm_out_op.register_fake
def _(
    a,
    b,
    out,
    accumulate,
    bias,
    activation,
    pre_out,
    grad_activation,
    pre_activation,
    grad_bias_out,
    splits,
    per_group,
    batch_invariant=False,
):
    return None
