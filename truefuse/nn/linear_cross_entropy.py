"""``truefuse.LinearCrossEntropyLoss``: the module form of ``truefuse.linear_cross_entropy``."""

from __future__ import annotations

import dataclasses

import torch

from truefuse.autograd._wgrad import DEFAULT_MAX_PENDING_WGRAD, WgradState, check_max_pending
from truefuse.autograd.linear_cross_entropy import linear_cross_entropy_with
from truefuse.nn._base import DelayedWgrad
from truefuse.ops._launch.dtensor import refuse_dtensor
from truefuse.ops.lm_head.linear_cross_entropy import LinearCrossEntropyOptions


class LinearCrossEntropyLoss(DelayedWgrad):
    """Holds the loss options; ``forward(input, linear_weight, target, linear_bias=None)``.

    Args:
        weight: (V,) per-class weights or None (a buffer, like ``torch.nn.CrossEntropyLoss``'s).
        reduction, ignore_index, label_smoothing, z_loss, softcap, return_z_loss,
        return_token_accuracy, return_predicted_tokens, chunk_size, fp32_weight_grad, memory,
        vocab_slice, fuse_wgrad_accumulation: as
        :func:`truefuse.linear_cross_entropy` (the last sends the weight gradient to
        ``linear_weight.main_grad`` per docs/design.md §2).
        delay_wgrad_compute: the weight gradient waits for :meth:`backward_dw` (docs/design.md §2): then
            added to ``linear_weight.grad``, or to its ``main_grad`` when fused.
            :attr:`pending_wgrad` counts the backward passes waiting.
            :meth:`register_wgrad_hook` reports each ``linear_weight`` passed to ``forward`` when
            its gradient is complete, as the modules do for their own weights.
        max_pending_wgrad: warn once when more than this many backward passes wait for
            :meth:`backward_dw` (default 16; None: never). Also a settable attribute.

    The options live in :attr:`options` (a frozen ``LinearCrossEntropyOptions``, checked when the
    module is built); each is also an attribute (``loss.reduction = "sum"`` replaces and re-checks
    :attr:`options`).

    Autocast: as :func:`truefuse.linear_cross_entropy`: GEMMs in the autocast dtype, the loss in
    fp32, as ``F.cross_entropy(F.linear(...).float(), target)`` under ``torch.autocast``.
    """

    def __init__(
        self,
        weight: torch.Tensor | None = None,
        reduction: str = "mean",
        ignore_index: int | None = None,
        label_smoothing: float = 0.0,
        *,
        z_loss: float = 0.0,
        softcap: float | None = None,
        return_z_loss: bool = False,
        return_token_accuracy: bool = False,
        return_predicted_tokens: bool = False,
        chunk_size: int | None = None,
        fp32_weight_grad: bool = True,
        memory: str = "default",
        vocab_slice: int | None = None,
        fuse_wgrad_accumulation: bool = False,
        delay_wgrad_compute: bool = False,
        max_pending_wgrad: int | None = DEFAULT_MAX_PENDING_WGRAD,
    ) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.options = LinearCrossEntropyOptions(
            reduction=reduction,
            ignore_index=ignore_index,
            label_smoothing=label_smoothing,
            z_loss=z_loss,
            softcap=softcap,
            return_z_loss=return_z_loss,
            return_token_accuracy=return_token_accuracy,
            return_predicted_tokens=return_predicted_tokens,
            chunk_size=chunk_size,
            fp32_weight_grad=fp32_weight_grad,
            memory=memory,
            vocab_slice=vocab_slice,
        )
        self._wgrad = WgradState(
            fuse_wgrad_accumulation=fuse_wgrad_accumulation,
            delay_wgrad_compute=delay_wgrad_compute,
            max_pending=check_max_pending(max_pending_wgrad),
            owner=type(self).__name__,
        )

    def _wgrad_params(self) -> list[torch.Tensor]:
        return []  # the weights come with each forward, which watches them (_watch_wgrad)

    def forward(self, input, linear_weight, target, linear_bias=None):
        refuse_dtensor("LinearCrossEntropyLoss", input=input, linear_weight=linear_weight, target=target, linear_bias=linear_bias)
        self._refuse_reducing_wrapper([linear_weight])
        if self._wgrad.hooks and isinstance(linear_weight, torch.Tensor) and linear_weight.requires_grad:
            self._watch_wgrad(linear_weight)
        return linear_cross_entropy_with(
            self.options,
            input,
            linear_weight,
            target,
            linear_bias=linear_bias,
            weight=self.weight,
            wgrad_state=self._wgrad,
        )

    def extra_repr(self) -> str:
        o = self.options
        return (
            f"reduction={o.reduction}, ignore_index={o.ignore_index}, label_smoothing={o.label_smoothing}, "
            f"z_loss={o.z_loss}, softcap={o.softcap}" + (f", memory={o.memory}" if o.memory != "default" else "")
        )


def _option(name: str) -> property:
    def get(self):
        return getattr(self.options, name)

    def set_(self, value):
        self.options = dataclasses.replace(self.options, **{name: value})

    return property(get, set_, doc=f"``options.{name}``; setting it replaces and re-checks :attr:`options`.")


for _field in dataclasses.fields(LinearCrossEntropyOptions):
    setattr(LinearCrossEntropyLoss, _field.name, _option(_field.name))
