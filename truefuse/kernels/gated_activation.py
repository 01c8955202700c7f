"""Triton kernels of the MLP activations: gated ``act(gate) * up`` (swiglu, geglu, geglu_tanh, reglu) and plain
``act(x)`` (``GATED=False``), forward and backward.

Gated inputs are a gate and an up (M, F) each, row-strided: two tensors, or the halves of one
(M, 2F) ``[gate, up]``; plain ones a gate only; outputs (M, F). Math in
fp32 and one rounding of each output (``act(g) * u``; backward ``dy * u * act'(g)`` and
``dy * act(g)``). With ``STORE_ACT`` the backward also writes the forward's output again, so a
caller that needs it in the backward (the next GEMM's weight gradient) recomputes it in the same
pass instead of keeping it. Grid: (rows, column blocks); offsets are int64.
"""

import triton
import triton.language as tl

from truefuse.kernels.activation import act_derivative, act_value


@triton.jit
def _gated_activation_fwd_kernel(
    g_ptr, u_ptr, y_ptr, stride_g, stride_u, stride_y, F, ACT: tl.constexpr, GATED: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    y = act_value(g, ACT)
    if GATED:
        y = y * tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_activation_bwd_kernel(
    dy_ptr,
    g_ptr,
    u_ptr,
    dg_ptr,
    du_ptr,
    a_ptr,
    stride_dy,
    stride_g,
    stride_u,
    stride_dg,
    stride_du,
    stride_a,
    F,
    ACT: tl.constexpr,
    GATED: tl.constexpr,
    STORE_ACT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    dy = tl.load(dy_ptr + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    act = act_value(g, ACT)
    if GATED:
        u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
        dg = dy * u * act_derivative(g, ACT)
        tl.store(du_ptr + row * stride_du + cols, (dy * act).to(du_ptr.dtype.element_ty), mask=mask)
        if STORE_ACT:
            tl.store(a_ptr + row * stride_a + cols, (act * u).to(a_ptr.dtype.element_ty), mask=mask)
    else:
        dg = dy * act_derivative(g, ACT)
        if STORE_ACT:
            tl.store(a_ptr + row * stride_a + cols, act.to(a_ptr.dtype.element_ty), mask=mask)
    tl.store(dg_ptr + row * stride_dg + cols, dg.to(dg_ptr.dtype.element_ty), mask=mask)
