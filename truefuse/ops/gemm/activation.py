"""Pointwise activations and their derivatives, as PyTorch computes them.

These are the references for every fused activation epilogue (GEMM epilogues, and later the
LayerNormMLP and GroupedMLP kernels). The derivative uses ATen's own backward ops, so the split path
of a fused epilogue is exactly what autograd would compute for the same tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: Activation names accepted wherever an ``activation=`` argument exists.
ACTIVATIONS: tuple[str, ...] = ("gelu", "gelu_tanh", "relu", "silu")


def check_activation(name: str | None, arg: str = "activation") -> None:
    """Raise ``ValueError`` naming ``arg`` when ``name`` is not a known activation (None is fine)."""
    if name is not None and name not in ACTIVATIONS:
        raise ValueError(f"{arg}={name!r} is not supported; choose one of {ACTIVATIONS} or None")


def activation_ref(x: torch.Tensor, name: str) -> torch.Tensor:
    """``name(x)`` elementwise, in ``x``'s dtype, as torch.nn.functional computes it."""
    if name == "gelu":
        return F.gelu(x)
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if name == "relu":
        return F.relu(x)
    if name == "silu":
        return F.silu(x)
    check_activation(name)
    raise AssertionError("unreachable")


def activation_grad_ref(grad: torch.Tensor, pre: torch.Tensor, name: str) -> torch.Tensor:
    """The gradient with respect to the activation's input: ``grad * name'(pre)``.

    Args:
        grad: gradient of the activation's output, any shape, float dtype.
        pre: the activation's input (the pre-activation), same shape and dtype as ``grad``.
        name: one of :data:`ACTIVATIONS`.

    Returns:
        A tensor of ``grad``'s shape and dtype, computed by the ATen backward op autograd uses
        (for bf16/fp16 it computes in fp32 and rounds once).
    """
    aten = torch.ops.aten
    if name == "gelu":
        return aten.gelu_backward(grad, pre, approximate="none")
    if name == "gelu_tanh":
        return aten.gelu_backward(grad, pre, approximate="tanh")
    if name == "relu":
        return aten.threshold_backward(grad, pre, 0)
    if name == "silu":
        return aten.silu_backward(grad, pre)
    check_activation(name, "grad_activation")
    raise AssertionError("unreachable")
