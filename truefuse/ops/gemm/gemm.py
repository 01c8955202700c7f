"""``truefuse.gemm``: the one entry point every matmul goes through, and ``gemm_ref`` beside it.

docs/design.md §3. The call validates its arguments (a clear error naming the argument, before anything
runs), asks the planner (``gemm_plan``) which backend fuses what, and runs the plan
(``gemm_exec``). ``gemm_ref`` is the same math in plain PyTorch, in the inputs' dtype: the fallback,
the test oracle (on float64 inputs) and the same-dtype baseline of the bounded contract.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Sequence
from typing import NamedTuple

import torch

from truefuse.config import is_batch_invariant
from truefuse.ops._launch.custom_op import custom_op, launch
from truefuse.ops._launch.dtensor import refuse_dtensor
from truefuse.ops._launch.triton import PLAIN_TENSORS as _PLAIN_TYPES
from truefuse.ops.gemm.activation import activation_grad_ref, activation_ref, check_activation
from truefuse.ops.gemm.bias_grad import split_bias_grad
from truefuse.ops.gemm.gemm_exec import GemmArgs, run
from truefuse.ops.gemm.gemm_plan import GemmPlan, GemmRequest, plan, plan_context

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


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


def _split_size(v) -> int:
    """One group size as a Python int: any integral scalar (``int``, a NumPy integer, a 0-dim
    integer tensor), never a bool or a float (``4.0`` is refused, not truncated)."""
    if isinstance(v, bool) or (isinstance(v, torch.Tensor) and (v.dim() != 0 or v.dtype == torch.bool)):
        raise TypeError
    if type(v).__module__ == "numpy" and getattr(getattr(v, "dtype", None), "kind", None) == "b":
        raise TypeError
    return operator.index(v)  # TypeError for floats and anything else not integral


def check_splits(m_splits, n_groups: int | None, total: int, axis: str) -> list[int]:
    """``m_splits`` as a list of Python ints, or a clear error naming ``m_splits``.

    Accepted: a 1-D integer tensor (a CUDA one costs one host sync), a 1-D NumPy integer array, or
    a list/tuple of integral scalars (``int``, NumPy integers such as ``list(np_array)`` gives,
    0-dim integer tensors). Refused: floats, bools, negative sizes, the wrong count or sum.
    """
    # the usual call first, a list of non-negative Python ints with the right count and sum, in one
    # pass: at 128 groups the general checks below cost ~25 us a call (H200 host), and a grouped
    # layer at 128 experts is host-bound (docs/log/benchmarks_2026-11.md, grouped GEMM follow-up). A copy: a
    # caller reusing its list cannot change what a backward saved
    if type(m_splits) is list and (n_groups is None or len(m_splits) == n_groups):
        if all(type(v) is int and v >= 0 for v in m_splits) and sum(m_splits) == total:
            return m_splits[:]
    expected = "m_splits must be a list of ints (Python or NumPy integers) or a 1-D integer tensor"
    if isinstance(m_splits, torch.Tensor):
        if m_splits.dim() != 1 or m_splits.dtype.is_floating_point or m_splits.dtype.is_complex or m_splits.dtype == torch.bool:
            raise TypeError(f"m_splits must be a 1-D integer tensor, got {m_splits.dtype} of shape {tuple(m_splits.shape)}")
        splits = [int(v) for v in m_splits.tolist()]  # a CUDA tensor costs one host sync here
    else:
        if type(m_splits).__module__ == "numpy" and getattr(m_splits, "ndim", None) == 1:
            if m_splits.dtype.kind not in "iu":
                raise TypeError(f"{expected}, got a NumPy array of dtype {m_splits.dtype}")
            m_splits = m_splits.tolist()
        if not isinstance(m_splits, Sequence) or isinstance(m_splits, (str, bytes)):
            raise TypeError(f"{expected}, got {type(m_splits).__name__}")
        splits = []
        for i, v in enumerate(m_splits):
            try:
                splits.append(_split_size(v))
            except TypeError:
                raise TypeError(f"{expected}; m_splits[{i}] is {v!r} ({type(v).__name__})") from None
    if any(v < 0 for v in splits):
        raise ValueError(f"m_splits has a negative group size: {splits}")
    if n_groups is not None and len(splits) != n_groups:
        raise ValueError(f"m_splits has {len(splits)} groups but there are {n_groups}")
    if sum(splits) != total:
        raise ValueError(f"m_splits sums to {sum(splits)} but {axis} is {total}")
    return splits


def _check_tensor(
    name: str, t: torch.Tensor | None, like: torch.Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]
) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != like.device:
        raise ValueError(f"{name} is on {t.device} but a is on {like.device}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
    if t.dtype not in dtypes:
        names = list(dict.fromkeys(str(d) for d in dtypes))
        raise TypeError(f"{name} has dtype {t.dtype}, expected {' or '.join(names)}")


def _check_no_autograd(**operands) -> None:
    """``gemm`` is not differentiable: it writes its result with ``out=``, outside autograd. An
    operand that would need a gradient (grad mode on, ``requires_grad``) is refused here, before
    anything runs, instead of failing deep in PyTorch ("functions with out=... arguments don't
    support automatic differentiation") or, for a Triton plan, returning a result with no graph."""
    if not torch.is_grad_enabled():
        return
    named = [n for n, t in operands.items() if isinstance(t, torch.Tensor) and t.requires_grad]
    if not named:
        return
    which = " and ".join(named)
    raise TypeError(
        f"gemm: {which} {'requires' if len(named) == 1 else 'require'} grad, but truefuse.gemm is not "
        "differentiable (it writes its result outside autograd). For a layer with gradients use "
        "truefuse.Linear (or LayerNormLinear, LayerNormMLP, GroupedLinear, GroupedMLP); to run the GEMM "
        f"itself on such tensors, call it under torch.no_grad() or pass {named[0]}.detach()"
    )


def _padded_rows(t: torch.Tensor) -> bool:
    """2-D row-major with room after each row (``buf[:, :N]`` of a wider ``buf``): cuBLAS and the
    Triton GEMM take the row stride as the leading dimension, so such an ``out`` is written in place."""
    return t.dim() == 2 and t.stride(1) == 1 and t.stride(0) >= max(1, t.shape[1])


def _aligned16(*ts: torch.Tensor) -> bool:
    return all(t.data_ptr() % 16 == 0 and all(s == 1 or (s * t.element_size()) % 16 == 0 for s in t.stride()) for t in ts)


def _validate(
    a,
    b,
    *,
    out=None,
    out_dtype=None,
    accumulate=False,
    bias=None,
    activation=None,
    return_pre_activation=False,
    grad_bias=False,
    grad_activation=None,
    pre_activation=None,
    m_splits=None,
    per_group=False,
    batch_invariant=None,
    want_request=True,
):
    """Check every argument; return (request, out shape, out dtype, splits, rows_mode). Without
    ``want_request`` the request is None (it reads addresses: the op builds it on real tensors)."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _FLOATS:
            raise TypeError(f"{name} has dtype {t.dtype}; gemm takes float16, bfloat16, float32 or float64")
    _check_no_autograd(a=a, b=b, bias=bias, pre_activation=pre_activation, out=out)
    if a.device != b.device:
        raise ValueError(f"a is on {a.device} but b is on {b.device}")
    if a.dtype != b.dtype:
        raise TypeError(f"a ({a.dtype}) and b ({b.dtype}) must have the same dtype")
    if a.device.type not in ("cpu", "cuda"):
        raise ValueError(f"gemm runs on cpu or cuda tensors, got device {a.device}")
    if a.dim() != 2:
        raise ValueError(f"a must be 2-D (M, K), got shape {tuple(a.shape)}")
    grouped = m_splits is not None
    if b.dim() == 3 and not grouped:
        raise ValueError(f"b is 3-D {tuple(b.shape)}: a grouped GEMM needs m_splits")
    if b.dim() not in (2, 3):
        raise ValueError(f"b must be 2-D (K, N), or 3-D (groups, K, N) with m_splits; got shape {tuple(b.shape)}")
    if a.shape[1] != b.shape[-2]:
        raise ValueError(f"a has {a.shape[1]} columns but b has {b.shape[-2]} rows (a @ b needs a.shape[1] == b.shape[-2])")
    M, K, N = a.shape[0], a.shape[1], b.shape[-1]
    rows_mode = b.dim() == 3
    splits = None
    if grouped:
        if rows_mode:
            splits = check_splits(m_splits, b.shape[0], M, "a.shape[0]")
        else:
            splits = check_splits(m_splits, None, K, "the contraction size a.shape[1]")
    n_groups = len(splits) if splits is not None else 0
    out_shape = (n_groups, M, N) if grouped and not rows_mode else (M, N)

    if out is not None and not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    if out_dtype is not None and not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"out_dtype must be a torch.dtype such as torch.float32, got {out_dtype!r}")
    if out_dtype is not None and out_dtype not in (a.dtype, torch.float32, torch.float64):
        allowed = " or ".join(dict.fromkeys(str(d) for d in (a.dtype, torch.float32)))
        raise TypeError(f"out_dtype={out_dtype} is not supported for {a.dtype} inputs; use {allowed}")
    if out_dtype is not None and out_dtype == torch.float64 and a.dtype != torch.float64:
        raise TypeError(f"out_dtype=torch.float64 needs float64 inputs, got {a.dtype}")
    if out_dtype is not None and a.dtype == torch.float64 and out_dtype != torch.float64:
        raise TypeError(f"float64 inputs give a float64 output, got out_dtype={out_dtype}")
    if out is not None:
        if out_dtype is not None and out.dtype != out_dtype:
            raise TypeError(f"out has dtype {out.dtype} but out_dtype is {out_dtype}")
        _check_tensor("out", out, a, out_shape, (a.dtype, torch.float32) if a.dtype != torch.float64 else (a.dtype,))
        if not (out.is_contiguous() or (not grouped and _padded_rows(out))):
            raise ValueError("out must be contiguous, or row-major with padded rows (stride(1) == 1, stride(0) >= N)")
        if bias is not None and not out.is_contiguous():
            # cuBLAS's fast kernels then add the bias as beta*C after rounding the product (1.41x
            # the error of the contiguous bias epilogue, bf16 on the H200): not this call's contract
            raise ValueError("bias with an out of padded rows: the bias would be added after rounding; pass a contiguous out")
    odt = out.dtype if out is not None else (out_dtype or a.dtype)
    if accumulate and out is None:
        raise ValueError("accumulate=True adds into an existing output: pass out=")
    if accumulate and (bias is not None or activation is not None):
        raise ValueError("accumulate=True (beta=1, the weight-gradient form) takes no bias or activation")

    check_activation(activation)
    check_activation(grad_activation, "grad_activation")
    if return_pre_activation and activation is None:
        raise ValueError("return_pre_activation=True needs an activation")
    if bias is not None:
        if grouped and not rows_mode:
            raise ValueError("bias applies to a forward GEMM; a grouped GEMM split along the contraction takes none")
        _check_tensor("bias", bias, a, (n_groups, N) if grouped else (N,), (a.dtype, odt))
    if (grad_activation is None) != (pre_activation is None):
        raise ValueError("grad_activation and pre_activation go together: give both or neither")
    _check_tensor("pre_activation", pre_activation, a, tuple(a.shape), (a.dtype,))
    if (grad_bias or grad_activation) and grouped and rows_mode:
        raise ValueError(
            "grad_bias/grad_activation belong to a weight-gradient GEMM (a = grad_output.t()); "
            "a grouped one is split along the contraction (b 2-D), not by rows of a (b 3-D)"
        )
    if batch_invariant is not None and not isinstance(batch_invariant, bool):
        raise TypeError(
            f"batch_invariant must be None (the truefuse.batch_invariant() switch) or a bool, got {batch_invariant!r}"
        )
    request = None
    if want_request:
        # resolved by the public entry (gemm_plan_for): None is not read as the switch here
        request = _request(
            a, b, odt, accumulate, bias, activation, grad_activation, grad_bias, grouped, per_group, batch_invariant is True
        )
    return request, out_shape, odt, splits, rows_mode


def _resolve_batch_invariant(batch_invariant):
    """``batch_invariant`` as a public call means it: None reads the switch
    (``truefuse.batch_invariant()``). The one place in ``ops/`` that reads it, called once at each
    public entry (:func:`gemm`, :func:`gemm_plan_for`); everything below takes a bool
    (``tests/test_layers.py``). Anything else is returned as given, for the argument check."""
    return is_batch_invariant() if batch_invariant is None else batch_invariant


def _request(
    a, b, odt, accumulate, bias, activation, grad_activation, grad_bias, grouped, per_group, batch_invariant=False
) -> GemmRequest:
    """What the planner is asked (reads the operands' addresses: run on real tensors, not traced)."""
    return GemmRequest(
        device=a.device.type,
        in_dtype=a.dtype,
        out_dtype=odt,
        accumulate=bool(accumulate),
        bias=bias is not None,
        activation=activation is not None,
        grad_activation=grad_activation is not None,
        grad_bias=bool(grad_bias),
        grouped=grouped,
        aligned=(not grouped) or _aligned16(a, b),
        per_group=grouped and bool(per_group),
        batch_invariant=bool(batch_invariant),
    )


def _check_out_not_aliased(out: torch.Tensor, **inputs) -> None:
    """Checked inside the op (eager or compiled), where storages have addresses."""
    for name, t in inputs.items():
        if t is not None and t.numel() and out.numel() and t.untyped_storage().data_ptr() == out.untyped_storage().data_ptr():
            raise ValueError(f"out shares memory with {name}; gemm cannot write its result over an input")


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
    refuse_dtensor("gemm", a=a, b=b, out=out, bias=bias, pre_activation=pre_activation, m_splits=m_splits)
    batch_invariant = _resolve_batch_invariant(batch_invariant)
    if activation is None and not (return_pre_activation or grad_bias) and pre_activation is None and m_splits is None:
        done = _plain_gemm(a, b, out, out_dtype, accumulate, bias, grad_activation, batch_invariant)
        if done is not None:
            return done
    return _gemm(
        a,
        b,
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
    out_dtype: torch.dtype | None = None,
    batch_invariant: bool,
) -> torch.Tensor:
    """``gemm(a, b, bias=bias, out_dtype=out_dtype, batch_invariant=batch_invariant)`` for callers
    inside truefuse (the Linear Function, the eager no-grad linear), which pass the mode their call
    read (``autograd/_modes.py``): the plain call's path when it takes the arguments, else
    :func:`gemm` itself (which checks them: DTensors, a traced call, anything unusual)."""
    done = _plain_gemm(a, b, None, out_dtype, False, bias, None, batch_invariant)
    if done is not None:
        return done
    return gemm(a, b, bias=bias, out_dtype=out_dtype, batch_invariant=batch_invariant)


def checked_plain_gemm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, odt: torch.dtype, bi: bool) -> torch.Tensor:
    """``plain_gemm(a, b, bias, out_dtype=odt, batch_invariant=bi)`` for a caller that has checked
    what :func:`_plain_gemm` checks (2-D plain tensors of one floating dtype and device, ``b``'s rows
    ``a``'s columns, ``bias`` (N,) of that dtype, ``odt`` that dtype or fp32, eager mode, nothing
    requiring grad): the same kept runner on a fresh output, without the checks' host time
    (``autograd/linear.py::_PlainLinearFunction``, three calls a Linear forward + backward)."""
    out = torch.empty((a.shape[0], b.shape[1]), dtype=odt, device=a.device)
    return _plain_runner(a, b, odt, False, bias is not None, bi)(a, b, out, odt, False, bias)


def _shares(out: torch.Tensor, t: torch.Tensor) -> bool:
    return t.numel() > 0 and t.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()


def _plain_gemm(a, b, out, out_dtype, accumulate, bias, grad_activation, batch_invariant) -> torch.Tensor | None:
    """``gemm``'s most common call (2-D operands, at most a bias, an ``out`` and ``accumulate``),
    in eager mode, when every argument is plainly valid: the same request, plan and product as the
    general path, without its checks' and plumbing's host time (a routed ``F.linear`` in
    batch-invariant mode paid ~130 µs of host time a call on an H100 host, where a decode-sized
    GEMM's kernel takes ~15 µs: docs/benchmarks.md, "Batch-invariant mode"). Returns None, having
    done nothing, wherever anything is unusual: the general path then checks (and raises the error
    naming the argument) and runs as always (tests/test_gemm_host.py)."""
    if type(a) not in _PLAIN_TYPES or type(b) not in _PLAIN_TYPES or grad_activation is not None:
        return None
    dt, dev = a.dtype, a.device
    if b.dtype is not dt or dt not in _FLOATS or a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        return None
    kind = dev.type
    if b.device != dev or kind not in ("cpu", "cuda") or type(batch_invariant) is not bool:
        return None
    if torch.is_grad_enabled() and (
        a.requires_grad or b.requires_grad or (bias is not None and bias.requires_grad) or (out is not None and out.requires_grad)
    ):
        return None  # the general path refuses it
    if torch.compiler.is_compiling():
        return None  # traced: through the custom op (docs/design.md §6.7)
    M, N = a.shape[0], b.shape[1]
    odt = (dt if out_dtype is None else out_dtype) if out is None else out.dtype
    if odt is not dt and not (odt is torch.float32 and dt is not torch.float64):
        return None
    if out is None:
        if accumulate:
            return None
    elif (
        type(out) not in _PLAIN_TYPES
        or (out_dtype is not None and out_dtype is not odt)
        or out.device != dev
        or out.shape != (M, N)
        or not out.is_contiguous()
        or (out.numel() and any(t is not None and _shares(out, t) for t in (a, b, bias)))
    ):
        return None
    if bias is not None and (
        accumulate
        or type(bias) not in _PLAIN_TYPES
        or bias.device != dev
        or bias.shape != (N,)
        or (bias.dtype is not dt and bias.dtype is not odt)
    ):
        return None
    accumulate = bool(accumulate)
    if out is None:
        out = torch.empty((M, N), dtype=odt, device=dev)
    return _plain_runner(a, b, odt, accumulate, bias is not None, batch_invariant)(a, b, out, odt, accumulate, bias)


def _plain_runner(a, b, odt, accumulate: bool, has_bias: bool, bi: bool):
    """The kept runner of the plain call's request (by :func:`plan_context` too)."""
    kind = a.device.type
    key = (kind, a.dtype, odt, accumulate, has_bias, bi, *plan_context(kind))
    runner = _RUNNERS.get(key)
    if runner is None:
        if len(_RUNNERS) >= _MAX_RUNNERS:
            _RUNNERS.clear()
        request = _request(a, b, odt, accumulate, True if has_bias else None, None, None, False, False, False, bi)
        runner = _RUNNERS[key] = _runner(plan(request))
    return runner


def runs_bi_triton(a: torch.Tensor, b: torch.Tensor, has_bias: bool) -> bool:
    """Whether the plain batch-invariant call ``gemm(a, b[, bias])`` (2-D, a's dtype out, not
    accumulated) runs as ``gemm_backends/triton.py::bi_launch`` plus a split bias add: what a fused
    launch of several such products must reproduce (``integrations/huggingface/siblings.py``)."""
    runner = _plain_runner(a, b, a.dtype, False, has_bias, True)
    return getattr(runner, "bi_launch", None) is a.dtype and a.shape[0] > 0 and b.shape[1] > 0


#: :func:`_plain_gemm`'s runners, by its request's fields and :func:`plan_context` (what the plan
#: depends on): the request, the plan and its executor looked up per call cost ~25 µs of host time
#: on the 2-core CI box, where a decode-sized batch-invariant GEMM's kernel takes ~15 µs on an
#: H100 (experiments/host_time.py bi-stubbed; docs/benchmarks.md, "Batch-invariant mode")
_RUNNERS: dict[tuple, object] = {}
_MAX_RUNNERS = 4096


def _runner(chosen: GemmPlan):
    """The call that runs ``chosen`` for :func:`_plain_gemm`: ``run(chosen, ...)``, or for the
    batch-invariant Triton product with at most a split bias (the mode's every forward and input
    gradient on CUDA) the very launch ``gemm_backends/triton.py::product`` makes, without the
    executor's steps around it; the split bias is then added as ``gemm_exec._run_one`` adds it."""

    def general(a, b, out, odt, accumulate, bias):
        return run(chosen, GemmArgs(a, b, out, odt, accumulate, bias, None, None, None, None, None), None, False)

    if chosen.backend == "torch" and not chosen.split and set(chosen.fused) <= {"mm", "out_dtype"}:
        return _torch_mm_runner(chosen, general)
    if not (
        chosen.backend == "triton"
        and "batch_invariant" in chosen.fused
        and set(chosen.split) <= {"bias"}
        and not {"accumulate", "bias"} & set(chosen.fused)
    ):
        return general
    from truefuse.ops.gemm.gemm_backends.triton import bi_launch

    def triton_bi(a, b, out, odt, accumulate, bias):
        if accumulate or a.dtype is not chosen.compute_dtype or a.shape[0] == 0 or b.shape[1] == 0:
            return general(a, b, out, odt, accumulate, bias)
        bi_launch(a, b, out)
        if bias is not None:  # split (the plan fuses none): added as gemm_exec._run_one adds it
            out.add_(bias.to(out.dtype))
        return out

    triton_bi.bi_launch = chosen.compute_dtype  # runs_bi_triton: it launches bi_launch for inputs of this dtype
    return triton_bi


def _torch_mm_runner(chosen: GemmPlan, general):
    """The runner of a bare product on the ``torch`` backend (the weight gradient in every mode,
    fast mode's GEMMs): the backend's product in its scope, as ``gemm_exec.run`` calls it for such a
    plan, without the executor's steps between."""
    from truefuse.ops.gemm.gemm_backends import get_backend

    backend = get_backend("torch")
    product, scope, fused = backend.product, backend.scope, chosen.fused

    def torch_mm(a, b, out, odt, accumulate, bias):
        if accumulate or bias is not None or a.dtype is not chosen.compute_dtype:
            return general(a, b, out, odt, accumulate, bias)
        with scope(a.device):
            product(GemmArgs(a, b, out, odt, False, None, None, None, None, None, None), a, b, fused, out, False)
        return out

    return torch_mm


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
    return _gemm(a, b, m_splits=m_splits, per_group=per_group, batch_invariant=batch_invariant, **kwargs)


def _gemm(a, b, **kw):
    """:func:`gemm`'s body: ``kw`` holds its keywords and the request's ``per_group`` flag (see
    :func:`gemm_groups`); every default there is None or False, so a missing one reads as its default
    (``batch_invariant``: False; the public entry resolved None to the switch)."""
    _, out_shape, odt, splits, rows_mode = _validate(a, b, want_request=False, **kw)
    out, accumulate, bias, activation = kw.get("out"), bool(kw.get("accumulate")), kw.get("bias"), kw.get("activation")
    grad_activation, pre_activation, per_group = kw.get("grad_activation"), kw.get("pre_activation"), kw.get("per_group")
    return_pre_activation, grad_bias = kw.get("return_pre_activation"), kw.get("grad_bias")
    bi = kw.get("batch_invariant") is True
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


# ---------------------------------------------------------------------------------------------
# The planned product as torch.library custom ops (docs/design.md §6.7): the plan is made and run
# inside the op, on real tensors (the request reads the operands' alignment), so a traced graph
# holds one opaque call per GEMM. ``gemm_op`` allocates its output (a fused grouped call returns
# its own); ``gemm_out_op`` writes or accumulates into a given one. Both write the optional
# pre-activation and bias-gradient outputs. Not differentiable: the autograd Functions call them
# on tensors that need no gradient.


def _execute(
    a, b, out, odt, accumulate, bias, activation, pre_out, grad_activation, pre_activation, gb_out, splits, per_group, bi
):
    grouped = splits is not None
    if out is not None:
        _check_out_not_aliased(out, a=a, b=b, bias=bias, pre_activation=pre_activation)
    request = _request(a, b, odt, accumulate, bias, activation, grad_activation, gb_out is not None, grouped, per_group, bi)
    chosen = plan(request)
    rows_mode = b.dim() == 3
    if out is None and "grouped" not in chosen.fused:  # a fused grouped call allocates its own
        out = torch.empty(_out_shape(a, b, splits), dtype=odt, device=a.device)
    args = GemmArgs(a, b, out, odt, bool(accumulate), bias, activation, pre_out, grad_activation, pre_activation, gb_out)
    return run(chosen, args, splits, rows_mode)


def _out_shape(a, b, splits) -> tuple[int, ...]:
    if splits is not None and b.dim() == 2:
        return (len(splits), a.shape[0], b.shape[-1])
    return (a.shape[0], b.shape[-1])


@custom_op("truefuse::gemm", mutates_args=("pre_out", "grad_bias_out"))
def gemm_op(
    a: torch.Tensor,
    b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    activation: str | None,
    pre_out: torch.Tensor | None,
    grad_activation: str | None,
    pre_activation: torch.Tensor | None,
    grad_bias_out: torch.Tensor | None,
    splits: list[int] | None,
    per_group: bool,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """The validated ``gemm`` without ``out=``: planned and run here; returns the new output."""
    return _execute(
        a,
        b,
        None,
        out_dtype,
        False,
        bias,
        activation,
        pre_out,
        grad_activation,
        pre_activation,
        grad_bias_out,
        splits,
        per_group,
        batch_invariant,
    )


@gemm_op.register_fake
def _(
    a,
    b,
    out_dtype,
    bias,
    activation,
    pre_out,
    grad_activation,
    pre_activation,
    grad_bias_out,
    splits,
    per_group,
    batch_invariant=False,
):
    return a.new_empty(_out_shape(a, b, splits), dtype=out_dtype)


# The common call (no pre-activation, no bias gradient) as an op that mutates nothing: traced, the
# mutating ``gemm_op`` with both its mutable arguments None became an auto_functionalized call that
# Inductor (torch 2.13) lowered to the op plus a ``getitem`` of its single tensor, and failed
# ("<built-in function getitem> is not an OpOverload"): every F.linear of a batch-invariant model
# under compile_layers (tests/hf/test_compile_layers.py).
@custom_op("truefuse::gemm_result", mutates_args=())
def gemm_result_op(
    a: torch.Tensor,
    b: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    activation: str | None,
    grad_activation: str | None,
    pre_activation: torch.Tensor | None,
    splits: list[int] | None,
    per_group: bool,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """``gemm_op`` without the optional outputs: returns the new output."""
    return _execute(
        a,
        b,
        None,
        out_dtype,
        False,
        bias,
        activation,
        None,
        grad_activation,
        pre_activation,
        None,
        splits,
        per_group,
        batch_invariant,
    )


@gemm_result_op.register_fake
def _(a, b, out_dtype, bias, activation, grad_activation, pre_activation, splits, per_group, batch_invariant=False):
    return a.new_empty(_out_shape(a, b, splits), dtype=out_dtype)


@custom_op("truefuse::gemm_out", mutates_args=("out", "pre_out", "grad_bias_out"))
def gemm_out_op(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    accumulate: bool,
    bias: torch.Tensor | None,
    activation: str | None,
    pre_out: torch.Tensor | None,
    grad_activation: str | None,
    pre_activation: torch.Tensor | None,
    grad_bias_out: torch.Tensor | None,
    splits: list[int] | None,
    per_group: bool,
    batch_invariant: bool = False,
) -> None:
    """The validated ``gemm`` with ``out=``: planned and run here, written (or added) into ``out``."""
    _execute(
        a,
        b,
        out,
        out.dtype,
        accumulate,
        bias,
        activation,
        pre_out,
        grad_activation,
        pre_activation,
        grad_bias_out,
        splits,
        per_group,
        batch_invariant,
    )


@gemm_out_op.register_fake
def _(
    a,
    b,
    out,
    accumulate,
    bias,
    activation,
    pre_out,
    grad_activation,
    pre_activation,
    grad_bias_out,
    splits,
    per_group,
    batch_invariant=False,
):
    return None


def gemm_plan_for(a: torch.Tensor, b: torch.Tensor, **kwargs) -> GemmPlan:
    """The plan ``gemm(a, b, **kwargs)`` would run, without running it (same validation)."""
    unknown = sorted(set(kwargs) - set(inspect.signature(gemm).parameters))
    if unknown:
        raise TypeError(f"gemm_plan_for: unknown gemm argument(s) {unknown}")
    kwargs["batch_invariant"] = _resolve_batch_invariant(kwargs.get("batch_invariant"))
    return plan(_validate(a, b, **kwargs)[0])


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
