"""Triton kernel of rotary position embedding as transformers computes it (``apply_rotary_pos_emb``).

For a head row ``x = [x1, x2]`` (halves of the head dimension D) and the row's ``cos = [c1, c2]``,
``sin = [s1, s2]``, the forward (``BACKWARD=False``) is the stock ``x * cos + rotate_half(x) * sin``
with the stock roundings: each product rounded, then the sum rounded:

    o1 = round(round(x1 * c1) - round(x2 * s1))      o2 = round(round(x2 * c2) + round(x1 * s2))

and the backward (``BACKWARD=True``, x = the output's gradient) is what autograd computes through
those ops, with the same roundings:

    g1 = round(round(x1 * c1) + round(x2 * s2))      g2 = round(round(x2 * c2) - round(x1 * s1))

so both are bit for bit the stock module's. Every rounding is to the output's dtype: in the forward
torch's promotion of x's and cos's dtypes (a bf16 query with fp32 cos under autocast gives fp32),
in the backward x's input's dtype (autograd casts each path's gradient to it before summing
them). Products use ``mul.rn`` on a GPU so that no product is contracted into a fused multiply-add
with the sum, in every dtype: with plain multiplies a bf16 rope compiled to ``fma.rn.bf16`` through
its casts (one rounding where stock rounds twice; tests/test_kernel_ptx.py reads the PTX). The
cost: Inductor cannot analyse inline assembly and takes every input of the kernel as written.
One program takes one (batch, position) row: every head of it, with cos/sin loaded once.
"""

import triton
import triton.language as tl


@triton.jit
def _mul_rn(a, b, INTERPRETED: tl.constexpr):
    if INTERPRETED:
        return a * b
    return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    T,
    H,
    sx_b,
    sx_h,
    sx_t,
    sc_b,
    sc_t,
    so_b,
    so_h,
    so_t,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BACKWARD: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b, t = row // T, row % T
    d = tl.arange(0, BLOCK_D)
    dm = d < HALF
    c_row = b * sc_b + t * sc_t  # cos and sin share their layout (the host checks)
    c1 = tl.load(cos_ptr + c_row + d, mask=dm, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + c_row + HALF + d, mask=dm, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + c_row + d, mask=dm, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + c_row + HALF + d, mask=dm, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty  # every rounding is to the output's dtype, as torch's ops round
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        m = (h[:, None] < H) & dm[None, :]
        xo = b * sx_b + h[:, None].to(tl.int64) * sx_h + t * sx_t + d[None, :]
        oo = b * so_b + h[:, None].to(tl.int64) * so_h + t * so_t + d[None, :]
        x1 = tl.load(x_ptr + xo, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + xo + HALF, mask=m, other=0.0).to(tl.float32)
        a1 = _mul_rn(x1, c1[None, :], INTERPRETED).to(dt).to(tl.float32)
        a2 = _mul_rn(x2, c2[None, :], INTERPRETED).to(dt).to(tl.float32)
        if BACKWARD:
            o1 = a1 + _mul_rn(x2, s2[None, :], INTERPRETED).to(dt).to(tl.float32)
            o2 = a2 - _mul_rn(x1, s1[None, :], INTERPRETED).to(dt).to(tl.float32)
        else:
            o1 = a1 - _mul_rn(x2, s1[None, :], INTERPRETED).to(dt).to(tl.float32)
            o2 = a2 + _mul_rn(x1, s2[None, :], INTERPRETED).to(dt).to(tl.float32)
        tl.store(out_ptr + oo, o1.to(dt), mask=m)
        tl.store(out_ptr + oo + HALF, o2.to(dt), mask=m)
