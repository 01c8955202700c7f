"""``truefuse.gemm``: the one entry point every matmul goes through, and ``gemm_ref`` beside it.

docs/design.md §3. Each entry checks its arguments once (``gemm_checks.validate``: a clear error
naming the argument, before anything runs). The common call, plainly valid, then takes its kept
runner (``gemm_runners``); every other call is planned (``gemm_plan``) and run (``gemm_exec``)
inside a custom op (``gemm_op``). ``gemm_ref`` is the same math in plain PyTorch, in the inputs'
dtype: the fallback, the test oracle (on float64 inputs) and the same-dtype baseline of the bounded
contract.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import NamedTuple

import torch

from truefuse.config import is_batch_invariant
from truefuse.ops._launch.custom_op import launch
from truefuse.ops.gemm.activation import activation_grad_ref, activation_ref
from truefuse.ops.gemm.bias_grad import split_bias_grad
from truefuse.ops.gemm.gemm_checks import Checked, check_splits, validate
from truefuse.ops.gemm.gemm_op import gemm_op, gemm_out_op, gemm_result_op
from truefuse.ops.gemm.gemm_plan import GemmPlan, plan, request
from truefuse.ops.gemm.gemm_runners import plain_runner


class GemmOutput(NamedTuple):
    """What ``gemm`` returns when asked for more than the product.

    Attributes:
        out: the result.
        pre_activation: ``a @ b + bias`` before the activation (when ``return_pre_activation``).
        grad_bias: the bias-gradient (when ``grad_bias``).
    """

    out: torch.Tensor
    pre_activation: torch.Tensor | None
    grad_bias: torch.Tensor | None


def _resolve_batch_invariant(batch_invariant) -> bool:
    """``batch_invariant`` as a public call means it: None reads the switch
    (``truefuse.batch_invariant()``), a bool is kept, anything else is the ``TypeError`` naming
    it. The one place in ``ops/`` that reads the switch and the one check of the argument, called
    once at each public entry (:func:`gemm`, :func:`gemm_plan_for`); everything below takes a bool
    (``tests/test_layers.py``)."""
    if batch_invariant is None:
        return is_batch_invariant()
    if type(batch_invariant) is not bool:
        raise TypeError(
            f"batch_invariant must be None (the truefuse.batch_invariant() switch) or a bool, got {batch_invariant!r}"
        )
    return batch_invariant


def gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    accumulate: bool = False,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    return_pre_activation: bool = False,
    grad_bias: bool = False,
    grad_activation: str | None = None,
    pre_activation: torch.Tensor | None = None,
    m_splits: Sequence[int] | torch.Tensor | None = None,
    batch_invariant: bool | None = None,
) -> torch.Tensor | GemmOutput:
    """``out = activation(a @ b + bias)``, or a weight-gradient GEMM, planned over the backends.

    Forward form: ``a`` (M, K) and ``b`` (K, N) of one float dtype (fp16, bf16, fp32, fp64), any
    strides (pass ``weight.t()`` for ``x @ Wᵀ``). ``bias`` (N,) in the input or output dtype;
    ``activation`` one of ``gelu``, ``gelu_tanh``, ``relu``, ``silu``; ``return_pre_activation``
    keeps ``a @ b + bias`` for the backward.

    Weight-gradient form: ``a = grad_output.t()`` (N, tokens), ``b = input`` (tokens, K).
    ``accumulate=True`` adds into ``out`` (beta=1), e.g. bf16 inputs into an fp32 ``main_grad``.
    ``grad_bias=True`` also returns the sum of the left operand over the contraction (tokens),
    the bias-gradient, shape (N,), in ``a``'s dtype. ``grad_activation`` with ``pre_activation``
    (shaped like ``a``: pass ``pre.t()``) first turns ``a`` into the gradient of the activation's
    input, ``a * act'(pre)`` rounded to ``a``'s dtype; the bias-gradient is taken after it.

    Output: ``out`` (written, or added into with ``accumulate``; contiguous, or for a 2-D result
    without bias row-major with padded rows such as ``buf[:, :N]``; dtype ``a``'s or fp32), else a
    new tensor of ``out_dtype`` (default ``a``'s dtype).

    Not differentiable: ``gemm`` is the low-level GEMM that truefuse's autograd Functions call on
    tensors that need no gradient. Under grad mode an ``a``, ``b``, ``bias``, ``pre_activation`` or
    ``out`` that requires grad raises ``TypeError`` before anything runs; use ``truefuse.Linear``
    (or the other modules) for gradients, or ``torch.no_grad()`` / ``.detach()`` for the raw GEMM.

    Grouped: with ``m_splits`` (a list of integral scalars, Python or NumPy ints, or a 1-D integer
    tensor; empty groups allowed),
    either ``b`` is (G, K, N) and ``a``'s rows are split (``bias`` (G, N)), or ``b`` is 2-D and the
    contraction is split: ``out`` is (G, N, K_b) and ``grad_bias`` (G, N), one weight-gradient per group.

    Batch invariance: ``batch_invariant=True`` (None, the default: whether
    ``truefuse.batch_invariant()`` is on) makes each output row bitwise independent of M and of
    the other rows of ``a`` (docs/design.md §1): the Triton GEMM with BLOCK_K fixed per dtype and a tile
    from the mode's table (``ops/gemm/gemm_bi_config.py``: chosen from M, every entry bitwise equal) where
    it runs, else the backend's product on fixed-size row blocks (docs/gemm.md).

    Returns:
        The output tensor, or a :class:`GemmOutput` ``(out, pre_activation, grad_bias)`` when
        ``return_pre_activation`` or ``grad_bias`` asks for more.

    Raises:
        TypeError / ValueError naming the argument for wrong types, shapes, dtypes, devices,
        ``m_splits``, an operand that requires grad (see above), or an ``out`` that cannot be
        written. Never "no algorithm": what a backend cannot fuse is split into the same math
        (see :func:`gemm_plan_for`).
    """
    batch_invariant = _resolve_batch_invariant(batch_invariant)
    checked = validate(
        a, b, out, out_dtype, accumulate, bias, activation, return_pre_activation, grad_bias, grad_activation,
        pre_activation, m_splits,
    )  # fmt: skip
    if checked.plain:  # the kept runner, into out or a new output
        odt, accumulate = checked.out_dtype, bool(accumulate)
        out = torch.empty(checked.out_shape, dtype=odt, device=a.device) if out is None else out
        return plain_runner(a, b, odt, accumulate, bias is not None, batch_invariant)(a, b, out, odt, accumulate, bias)
    return _gemm(
        a,
        b,
        checked,
        out=out,
        out_dtype=out_dtype,
        accumulate=accumulate,
        bias=bias,
        activation=activation,
        return_pre_activation=return_pre_activation,
        grad_bias=grad_bias,
        grad_activation=grad_activation,
        pre_activation=pre_activation,
        m_splits=m_splits,
        per_group=False,
        batch_invariant=batch_invariant,
    )


def plain_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    accumulate: bool = False,
    batch_invariant: bool,
    dtensors_refused: bool = False,
) -> torch.Tensor:
    """``gemm(a, b, bias=bias, out=out, out_dtype=out_dtype, accumulate=accumulate,
    batch_invariant=batch_invariant)`` for callers inside truefuse (the Linear Function, the eager
    no-grad linear, the LM head's GEMMs), which pass the mode their call read as a bool
    (``autograd/_modes.py``): :func:`gemm`'s path for these arguments, checked once.
    ``dtensors_refused``: the caller's public entry refused DTensor operands already (the LM head's
    entries: ``linear_cross_entropy``, ``linear_log_probs``, their modules, ``head_logits``, the
    vocab-parallel loss), so a call that is not plain meets the general checks without a second
    refusal."""
    checked = validate(a, b, out, out_dtype, accumulate, bias, refuse_dtensors=not dtensors_refused)
    if checked.plain:  # as gemm's
        odt, accumulate = checked.out_dtype, bool(accumulate)
        out = torch.empty(checked.out_shape, dtype=odt, device=a.device) if out is None else out
        return plain_runner(a, b, odt, accumulate, bias is not None, batch_invariant)(a, b, out, odt, accumulate, bias)
    return _gemm(a, b, checked, out=out, bias=bias, out_dtype=out_dtype, accumulate=accumulate, batch_invariant=batch_invariant)


def checked_plain_gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, odt: torch.dtype, bi: bool) -> torch.Tensor:
    """``plain_gemm(a, b, bias, out_dtype=odt, batch_invariant=bi)`` for a caller that has checked
    what ``gemm_checks.validate``'s first step checks (2-D plain tensors of one floating dtype and device, ``b``'s rows
    ``a``'s columns, ``bias`` (N,) of that dtype, ``odt`` that dtype or fp32, eager mode, nothing
    requiring grad): the same kept runner on a fresh output, without the checks' host time
    (``autograd/linear.py::_PlainLinearFunction``, three calls a Linear forward + backward)."""
    out = torch.empty((a.shape[0], b.shape[1]), dtype=odt, device=a.device)
    return plain_runner(a, b, odt, False, bias is not None, bi)(a, b, out, odt, False, bias)


def gemm_groups(
    a: torch.Tensor, b: torch.Tensor, *, m_splits, per_group: bool, batch_invariant: bool, **kwargs
) -> torch.Tensor | GemmOutput:
    """``gemm(a, b, m_splits=m_splits, batch_invariant=batch_invariant, **kwargs)``, saying in the
    request how the groups are run; ``batch_invariant``: the mode the caller's forward read.

    ``per_group=True``: one GEMM per group, each exactly the call ``gemm`` makes on that group's
    slices, never a fused grouped product (cuBLAS ``grouped_mm`` rounds differently: on the H200 a
    4096×4096 forward and input gradient differed). ``GroupedLinear``/``GroupedMLP`` ask for this to
    equal one ``Linear`` per group bit for bit. ``per_group=False``: as ``gemm``, the planner fuses
    the grouped product where a backend offers it. The plan is otherwise the same.

    Named apart from ``ops/grouped_gemm/grouped_gemm.py``, the batch-invariant Triton grouped GEMM, which the
    planner does not choose (docs/design.md §3).
    """
    if m_splits is None:
        raise ValueError("gemm_groups needs m_splits")
    checked = validate(a, b, m_splits=m_splits, **kwargs, refuse_dtensors=False)  # as always: no DTensor refusal here
    return _gemm(a, b, checked, m_splits=m_splits, per_group=per_group, batch_invariant=batch_invariant, **kwargs)


def _gemm(a, b, checked: Checked, *, per_group=False, **kw):
    """:func:`gemm`'s general path: ``kw`` holds its keywords, ``per_group`` the request's flag (see
    :func:`gemm_groups`), ``checked`` what the entry's ``validate`` found; every default there is
    None or False, so a missing one reads as its default (``batch_invariant``: a bool, which every
    entry resolved)."""
    out_shape, odt, splits, rows_mode = checked.out_shape, checked.out_dtype, checked.splits, checked.rows_mode
    out, accumulate, bias, activation = kw.get("out"), bool(kw.get("accumulate")), kw.get("bias"), kw.get("activation")
    grad_activation, pre_activation = kw.get("grad_activation"), kw.get("pre_activation")
    return_pre_activation, grad_bias = kw.get("return_pre_activation"), kw.get("grad_bias")
    bi = kw.get("batch_invariant", False)
    pre_out = torch.empty(out_shape, dtype=odt, device=a.device) if return_pre_activation else None
    gb_shape = (len(splits), a.shape[0]) if (splits is not None and not rows_mode) else (a.shape[0],)
    gb_out = torch.empty(gb_shape, dtype=a.dtype, device=a.device) if grad_bias else None
    if out is None and pre_out is None and gb_out is None:
        out = launch(gemm_result_op, a, b, odt, bias, activation, grad_activation, pre_activation, splits, bool(per_group), bi)
    elif out is None:
        out = launch(
            gemm_op, a, b, odt, bias, activation, pre_out, grad_activation, pre_activation, gb_out, splits, bool(per_group), bi
        )
    else:
        launch(
            gemm_out_op,
            a,
            b,
            out,
            bool(accumulate),
            bias,
            activation,
            pre_out,
            grad_activation,
            pre_activation,
            gb_out,
            splits,
            bool(per_group),
            bi,
        )
    if return_pre_activation or grad_bias:
        return GemmOutput(out, pre_out, gb_out)
    return out


def gemm_plan_for(a: torch.Tensor, b: torch.Tensor, **kwargs) -> GemmPlan:
    """The plan ``gemm(a, b, **kwargs)`` would run, without running it (same validation)."""
    unknown = sorted(set(kwargs) - set(inspect.signature(gemm).parameters))
    if unknown:
        raise TypeError(f"gemm_plan_for: unknown gemm argument(s) {unknown}")
    bi = _resolve_batch_invariant(kwargs.pop("batch_invariant", None))
    # no DTensor refusal, as before the one validator: a plan is asked of the local tensors' shapes
    checked = validate(a, b, **kwargs, refuse_dtensors=False)
    get = kwargs.get
    grouped = get("m_splits") is not None
    return plan(
        request(
            a,
            b,
            checked.out_dtype,
            get("accumulate", False),
            get("bias"),
            get("activation"),
            get("grad_activation"),
            get("grad_bias", False),
            grouped,
            False,
            bi,
        )  # fmt: skip
    )


def gemm_ref(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    accumulate: bool = False,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    return_pre_activation: bool = False,
    grad_bias: bool = False,
    grad_activation: str | None = None,
    pre_activation: torch.Tensor | None = None,
    m_splits: Sequence[int] | torch.Tensor | None = None,
    batch_invariant: bool | None = None,
) -> torch.Tensor | GemmOutput:
    """The unfused composition ``gemm`` must match, in plain PyTorch, in ``a``'s dtype.

    Same arguments and results as :func:`gemm` (``batch_invariant`` is accepted and ignored: the
    reference is the math, not a reduction order), except that ``out`` is only read (with
    ``accumulate`` the result is ``out + product``, a new tensor) and every step rounds to ``a``'s
    dtype as eager PyTorch would: the product is ``a @ b`` in ``a``'s dtype, then converted to the
    output dtype, then bias, then activation. On float64 inputs it is the float64 reference.
    """
    if m_splits is not None:
        if b.dim() == 3:
            splits = check_splits(m_splits, b.shape[0], a.shape[0], "a.shape[0]")
        else:
            splits = check_splits(m_splits, None, a.shape[1], "the contraction size a.shape[1]")
        outs, pres, gbs, start = [], [], [], 0
        for g, m in enumerate(splits):
            sl = slice(start, start + m)
            start += m
            if b.dim() == 3:
                r = gemm_ref(
                    a[sl],
                    b[g],
                    out_dtype=out_dtype or (out.dtype if out is not None else None),
                    bias=None if bias is None else bias[g],
                    activation=activation,
                    return_pre_activation=return_pre_activation,
                )
            else:
                r = gemm_ref(
                    a[:, sl],
                    b[sl],
                    out=None if out is None else out[g],
                    out_dtype=out_dtype,
                    accumulate=accumulate,
                    grad_bias=grad_bias,
                    grad_activation=grad_activation,
                    pre_activation=None if pre_activation is None else pre_activation[:, sl],
                )
            r = r if isinstance(r, GemmOutput) else GemmOutput(r, None, None)
            outs.append(r.out), pres.append(r.pre_activation), gbs.append(r.grad_bias)
        cat = torch.cat if b.dim() == 3 else torch.stack
        res = GemmOutput(
            cat(outs) if outs else torch.empty(0),
            cat(pres) if return_pre_activation else None,
            torch.stack(gbs) if grad_bias else None,
        )
        return res if (return_pre_activation or grad_bias) else res.out

    odt = out.dtype if out is not None else (out_dtype or a.dtype)
    if grad_activation is not None:
        a = activation_grad_ref(a, pre_activation, grad_activation)
    gb = split_bias_grad(a.t()) if grad_bias else None
    y = (a @ b).to(odt)
    if bias is not None:
        y = y + bias.to(odt)
    pre = y
    if activation is not None:
        y = activation_ref(y, activation)
    if accumulate:
        y = out + y
    if return_pre_activation or grad_bias:
        return GemmOutput(y, pre if return_pre_activation else None, gb)
    return y
