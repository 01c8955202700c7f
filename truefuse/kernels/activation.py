"""Triton device functions for activation derivatives, shared by every kernel with an activation.

Codes are ``tl.constexpr`` integers so that the derivative is selected at compile time.
Each returns ``act'(x)`` in fp32 for an fp32 ``x``; the formulas are PyTorch's (ATen's
``gelu_backward``, ``threshold_backward``, ``silu_backward``).
"""

import triton
import triton.language as tl

ACT_NONE, ACT_GELU, ACT_GELU_TANH, ACT_RELU, ACT_SILU = 0, 1, 2, 3, 4

#: name -> constexpr code, the one mapping host code uses.
ACT_CODES = {None: ACT_NONE, "gelu": ACT_GELU, "gelu_tanh": ACT_GELU_TANH, "relu": ACT_RELU, "silu": ACT_SILU}


@triton.jit
def act_derivative(x, ACT: tl.constexpr):
    """``act'(x)`` for fp32 ``x``."""
    if ACT == 1:  # gelu (erf): Phi(x) + x * phi(x)
        cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
        pdf = tl.exp(-0.5 * x * x) * 0.3989422804014327
        d = cdf + x * pdf
    elif ACT == 2:  # gelu (tanh approximation)
        k = 0.7978845608028654  # sqrt(2 / pi)
        x2 = x * x
        inner = k * (x + 0.044715 * x2 * x)
        t = 2.0 * tl.sigmoid(2.0 * inner) - 1.0  # tanh(inner)
        d = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * x2)
    elif ACT == 3:  # relu: threshold_backward passes the gradient where x > 0
        d = tl.where(x > 0.0, 1.0, 0.0)
    elif ACT == 4:  # silu: s * (1 + x * (1 - s))
        s = tl.sigmoid(x)
        d = s * (1.0 + x * (1.0 - s))
    else:
        d = tl.full(x.shape, 1.0, tl.float32)
    return d


@triton.jit
def act_value(x, ACT: tl.constexpr):
    """``act(x)`` for fp32 ``x``, with PyTorch's formulas."""
    if ACT == 1:  # gelu (erf)
        y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACT == 2:  # gelu (tanh approximation)
        inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        y = 0.5 * x * (1.0 + (2.0 * tl.sigmoid(2.0 * inner) - 1.0))
    elif ACT == 3:  # relu
        y = tl.maximum(x, 0.0)
    elif ACT == 4:  # silu
        y = x * tl.sigmoid(x)
    else:
        y = x
    return y
