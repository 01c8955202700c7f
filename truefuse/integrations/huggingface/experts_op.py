"""The experts' grouped MLP with host group sizes as one opaque custom op, for ``torch.export``.

The ``per_group`` and ``cublas_grouped`` backends run one GEMM per expert from Python ints
(``GroupedMLPFunction`` with ``GroupSpec.splits``): in eager mode the experts forward reads the
per-expert counts on the host (``moe._route``). Under ``torch.export`` that read is a
data-dependent value the tracer cannot guard on (issue 31: a patched Mixtral did not export where
stock does). :func:`experts_mlp` keeps the counts a tensor in the traced graph: the op's body
reads them on the host when it runs, which a traced program may do inside an op, and runs the
same ``GroupedMLPFunction`` forward as eager, so an exported program gives the eager patched
model's bits. Its backward recomputes that forward under autograd (one extra forward of the
experts, only in exported programs; eager training never takes this path).

The ``triton`` backend needs none of this: its group offsets are device tensors already.
"""

from __future__ import annotations

import torch

from truefuse.autograd._wgrad import WgradState
from truefuse.autograd.grouped import GroupedMLPFunction, GroupSpec
from truefuse.ops._launch.capture import refuse_under_capture


def _run(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, counts: torch.Tensor, activation: str, backend: str):
    refuse_under_capture(counts, f"the experts' group sizes (experts_backend={backend!r})")
    splits = tuple(int(c) for c in counts.tolist())
    spec1 = GroupSpec(splits, True, False, ("gate_up_proj",), path=backend)
    spec2 = GroupSpec(splits, True, False, ("down_proj",), path=backend)
    return GroupedMLPFunction.apply(x, spec1, spec2, activation, WgradState(owner="experts"), w1, w2)


@torch.library.custom_op("truefuse::hf_experts_mlp", mutates_args=())
def experts_mlp(
    x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, counts: torch.Tensor, activation: str, backend: str
) -> torch.Tensor:
    """``truefuse.GroupedMLP``'s function on the HF experts' packed weights, sizes from a tensor.

    Args:
        x: (R, H) rows ordered by expert.
        w1: (E, 2F, H) ``gate_up_proj``; w2: (E, H, F) ``down_proj``; one floating dtype, ``x``'s.
        counts: (E,) int64 rows per expert, summing to R (read on the host when the op runs).
        activation: the gated activation (``swiglu``, ``geglu``, ``geglu_tanh``, ``reglu``).
        backend: ``per_group`` or ``cublas_grouped``.

    Returns:
        (R, H) in ``x``'s dtype, the bits of the eager experts forward on the same rows.
    """
    with torch.no_grad():
        return _run(x, w1, w2, counts, activation, backend)


@experts_mlp.register_fake
def _(x, w1, w2, counts, activation, backend):
    return x.new_empty(x.shape[0], w2.shape[1])


def _setup(ctx, inputs, output) -> None:
    x, w1, w2, counts, ctx.activation, ctx.backend = inputs
    ctx.save_for_backward(x, w1, w2, counts)


def _backward(ctx, dy):
    x, w1, w2, counts = ctx.saved_tensors
    wanted = ctx.needs_input_grad[:3]
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(w) for t, w in zip((x, w1, w2), wanted, strict=True)]
        y = _run(*leaves, counts, ctx.activation, ctx.backend)
        needed = [t for t in leaves if t.requires_grad]
        grads = iter(torch.autograd.grad(y, needed, dy) if needed else ())
    return *(next(grads) if w else None for w in wanted), None, None, None


experts_mlp.register_autograd(_backward, setup_context=_setup)
