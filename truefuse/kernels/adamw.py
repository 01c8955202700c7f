"""One AdamW step over many tensors in one launch, each element as torch's single-tensor
capturable AdamW computes it (``torch/optim/adam.py::_single_tensor_adam``, ``capturable=True``).

The launch is multi-tensor through a table (``ops/adamw.py`` builds it): per tensor its addresses
and size, per program the tensor and the first element of its chunk. A launch per parameter costs
~20 µs of host time each (docs/design.md §6.10), ~150 of them a Llama step; flattening the
parameters into one buffer would copy them (or require the model's storage to be one buffer). The
table keeps every tensor where it is, and an element's arithmetic never depends on how many
tensors share the launch (docs/design.md §1, batch invariance).

Torch's ops, in order, each rounded to the storage dtype ``S`` as torch's in-place op stores it
(fp32 "opmath" inside each op; ``R`` below is that rounding, a no-op in fp32):

    p = R(p * wd_factor)                       param.mul_(1 - lr * weight_decay), if weight_decay
    m = R(lerp(m, g, 1 - beta1))               exp_avg.lerp_(grad, 1 - beta1)
    v = R(v * beta2); v = R(addcmul(v, g, g))  exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    s = R(sqrt(v)); q = R(s / A); d = R(q + D) denom = (exp_avg_sq.sqrt() / A).add_(D)
    p = R(p + m / d)                           param.addcdiv_(exp_avg, denom)

with ``A = sqrt(1 - beta2^t) * -(lr / (1 - beta1^t))`` and ``D = eps / -(lr / (1 - beta1^t))``
computed per tensor by torch itself on the device (the launcher: its ``pow`` is the device's own,
which a kernel could not reproduce) and handed over as the elementwise op sees them (on CUDA a
0-dim device tensor enters a bf16 op rounded to bf16; ``ops/adamw.py::device_scalars``).

Where torch's two devices disagree, the launcher says which (``SQ_FORM``): CUDA's ``addcmul``
rounds ``g * g`` first, ``fma(c, g * g, v)`` (``pointwise_op_impl``, and ``fma(g, g, v)`` when
``c == 1``), the CPU's ``c * g`` first, ``fma(c * g, g, v)`` (measured, torch 2.13, AVX-512).
``lerp`` is ``fma(w, g - m, m)`` for ``|w| < 0.5``, else ``fma(w - 1, g - m, g)``, on both.
Divisions and square roots are IEEE (``div_rn``, ``sqrt_rn``); no other product is fused into an
add: the launch passes ``enable_fp_fusion=False``.

With master weights the fp32 master copy is what torch's AdamW steps (``S`` = fp32) and the
parameter receives its rounding.
"""

import triton
import triton.language as tl


@triton.jit
def _adamw_block(p_ptr, g_ptr, m_ptr, v_ptr, w_ptr, offs, mask, wdf, A, D, w1, b2, c2,
                 S_DT: tl.constexpr, MASTER: tl.constexpr, HAS_WD: tl.constexpr,
                 LERP_SMALL: tl.constexpr, SQ_FORM: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """One block of one tensor: load, the ops of the module doc, store."""
    if MASKED:
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if MASTER:
            x = tl.load(w_ptr + offs, mask=mask, other=0.0)
        else:
            x = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        g = tl.load(g_ptr + offs).to(tl.float32)
        m = tl.load(m_ptr + offs).to(tl.float32)
        v = tl.load(v_ptr + offs).to(tl.float32)
        if MASTER:
            x = tl.load(w_ptr + offs)
        else:
            x = tl.load(p_ptr + offs).to(tl.float32)
    if HAS_WD:
        x = (x * wdf).to(S_DT).to(tl.float32)
    d = g - m
    if LERP_SMALL:
        m = tl.fma(w1, d, m).to(S_DT)
    else:
        m = tl.fma(w1 - 1.0, d, g).to(S_DT)
    v = (v * b2).to(S_DT).to(tl.float32)
    if SQ_FORM == 0:
        v = tl.fma(c2 * g, g, v).to(S_DT)
    else:
        v = tl.fma(c2, g * g, v).to(S_DT)
    s = tl.sqrt_rn(v.to(tl.float32)).to(S_DT).to(tl.float32)
    q = tl.div_rn(s, A).to(S_DT).to(tl.float32)
    den = (q + D).to(S_DT).to(tl.float32)
    x = (x + tl.div_rn(m.to(tl.float32), den)).to(S_DT)
    if MASKED:
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        if MASTER:
            tl.store(w_ptr + offs, x, mask=mask)
        tl.store(p_ptr + offs, x.to(p_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(m_ptr + offs, m)
        tl.store(v_ptr + offs, v)
        if MASTER:
            tl.store(w_ptr + offs, x)
        tl.store(p_ptr + offs, x.to(p_ptr.dtype.element_ty))


@triton.jit
def _adamw_kernel(
    table,  # int64 (T, 6): param, grad, exp_avg, exp_avg_sq, master (0: none) addresses, numel
    chunks,  # int64 (C, 2): the tensor of each program, the first element of its chunk
    scalars,  # fp32 (T, 3): the weight-decay factor, A, D of each tensor (module doc)
    p_like,  # a parameter, a gradient and a state of the launch: their dtypes type the table's addresses
    g_like,
    s_like,
    w1,  # fp32(1 - beta1), lerp's weight
    b2,  # fp32(beta2)
    c2,  # fp32(1 - beta2), addcmul's value
    MASTER: tl.constexpr,
    HAS_WD: tl.constexpr,
    LERP_SMALL: tl.constexpr,  # |1 - beta1| < 0.5: lerp's first form
    SQ_FORM: tl.constexpr,  # 0: fma(c * g, g, v), 1: fma(c, g * g, v) (module doc)
    ALIGNED: tl.constexpr,  # every address 16-byte aligned: the loads may be vectors
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,  # elements a program updates: a multiple of BLOCK
):
    pid = tl.program_id(0)
    t = tl.load(chunks + 2 * pid)
    start = tl.multiple_of(tl.load(chunks + 2 * pid + 1), CHUNK)
    row = table + 6 * t
    n = tl.load(row + 5)
    S_DT: tl.constexpr = s_like.dtype.element_ty
    p_ptr = tl.load(row + 0).to(tl.pointer_type(p_like.dtype.element_ty))
    g_ptr = tl.load(row + 1).to(tl.pointer_type(g_like.dtype.element_ty))
    m_ptr = tl.load(row + 2).to(tl.pointer_type(S_DT))
    v_ptr = tl.load(row + 3).to(tl.pointer_type(S_DT))
    w_ptr = tl.load(row + 4).to(tl.pointer_type(tl.float32))
    if ALIGNED:
        p_ptr = tl.multiple_of(p_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        m_ptr = tl.multiple_of(m_ptr, 16)
        v_ptr = tl.multiple_of(v_ptr, 16)
        w_ptr = tl.multiple_of(w_ptr, 16)
    wdf = tl.load(scalars + 3 * t)
    A = tl.load(scalars + 3 * t + 1)
    D = tl.load(scalars + 3 * t + 2)
    for b in range(0, CHUNK, BLOCK):
        offs = start + b + tl.arange(0, BLOCK)
        if start + b + BLOCK <= n:  # a whole block: no mask, so the loads stay vectors
            _adamw_block(p_ptr, g_ptr, m_ptr, v_ptr, w_ptr, offs, offs < n, wdf, A, D, w1, b2, c2,
                         S_DT, MASTER, HAS_WD, LERP_SMALL, SQ_FORM, False)  # fmt: skip
        else:
            _adamw_block(p_ptr, g_ptr, m_ptr, v_ptr, w_ptr, offs, offs < n, wdf, A, D, w1, b2, c2,
                         S_DT, MASTER, HAS_WD, LERP_SMALL, SQ_FORM, True)  # fmt: skip
