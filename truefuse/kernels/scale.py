"""In-place scaling by a factor held on the device, skipped when the factor is exactly 1.

The loss functions compute their gradients in the forward and scale them by ``grad_output`` in the
backward. ``grad_output`` is almost always 1, but it lives on the device: reading it on the host
would synchronise. Here every program reads it and leaves at once when it is 1 (x · 1 = x for every
x, NaN and -0 included, so skipping is exact); otherwise it multiplies in fp32 and rounds once, as
PyTorch's ``mul_`` by an fp32 0-dim tensor does.
"""

import triton
import triton.language as tl


@triton.jit
def _scale_inplace_kernel(x_ptr, n, factor_ptr, BLOCK: tl.constexpr):
    f = tl.load(factor_ptr)
    if f != 1.0:
        pid = tl.program_id(0)
        P = tl.num_programs(0)
        for i in range(0, tl.cdiv(n, P * BLOCK)):
            offs = (i * P + pid).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            m = offs < n
            v = tl.load(x_ptr + offs, mask=m)
            tl.store(x_ptr + offs, (v.to(tl.float32) * f).to(x_ptr.dtype.element_ty), mask=m)
