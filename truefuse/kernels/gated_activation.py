"""Triton kernels of the gated activations (swiglu, geglu, reglu): ``act(gate) * up``.

The input is (M, 2F) split in halves ``[gate, up]``; the output (M, F). Math in fp32 and one
rounding of each output (``act(g) * u``; in the backward ``dy * u * act'(g)`` and ``dy * act(g)``).
Grid: (rows, column blocks); offsets are int64.
"""

import triton
import triton.language as tl

from truefuse.kernels.activation import act_derivative, act_value


@triton.jit
def _gated_activation_fwd_kernel(x_ptr, y_ptr, stride_x, stride_y, F, ACT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + F + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (act_value(g, ACT) * u).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_activation_bwd_kernel(
    dy_ptr, x_ptr, dx_ptr, stride_dy, stride_x, stride_dx, F, ACT: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    dy = tl.load(dy_ptr + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + F + cols, mask=mask, other=0.0).to(tl.float32)
    dg = dy * u * act_derivative(g, ACT)
    du = dy * act_value(g, ACT)
    tl.store(dx_ptr + row * stride_dx + cols, dg.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dx_ptr + row * stride_dx + F + cols, du.to(dx_ptr.dtype.element_ty), mask=mask)
