"""The gated activation's backward that also recomputes its output, as a custom op
(docs/design.md §6.7): GroupedMLP's backward needs ``act(h)`` again for fc2's weight gradient and
gets it from the same pass over ``h`` (``ops.gated_activation.gated_bwd(..., recompute=True)``)."""

from __future__ import annotations

import torch

from truefuse.ops._launch.custom_op import custom_op, no_double_backward
from truefuse.ops.gated_activation.gated_activation import GATED_ACTIVATIONS, gated_bwd


@custom_op("truefuse::gated_activation_bwd_recompute", mutates_args=())
def gated_bwd_recompute_op(dy: torch.Tensor, x: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, act(x))`` for contiguous (M, 2F) or (M, F) ``x`` and (M, F) ``dy``."""
    return gated_bwd(dy.contiguous(), x, name, recompute=True)


@gated_bwd_recompute_op.register_fake
def _(dy, x, name):
    F = x.shape[1] // (2 if name in GATED_ACTIVATIONS else 1)
    return torch.empty_like(x), x.new_empty((x.shape[0], F))


# only ever called inside a backward; registered so a traced backward graph may hold it
no_double_backward(gated_bwd_recompute_op, "GroupedMLP", "truefuse.GroupedMLP.forward_ref")
