"""The one check of ``truefuse.gemm``'s arguments (docs/design.md §3): :func:`validate`.

Every entry point (``gemm``, ``gemm_groups``, ``gemm_plan_for``, the internal ``plain_gemm``) asks
it once, before anything runs, and gets a :class:`Checked`. It answers in two steps. The common call
(2-D operands, at most a bias, an ``out`` and ``accumulate``, eager mode) that is plainly valid is
accepted first, by a few identity and shape tests, without the general checks' host time (a routed
``F.linear`` in batch-invariant mode paid ~130 µs of host time a call on an H100 host, where a
decode-sized GEMM's kernel takes ~15 µs: docs/benchmarks.md, "Batch-invariant mode"); that call may
then take the kept runner (``gemm_runners.py``). Anything else meets the general checks, each a
clear error naming the argument. What the first step accepts the second would accept too, so the
step taken changes the path, never the verdict (tests/test_gemm_host.py).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import NamedTuple

import torch

from truefuse.ops._launch.capture import refuse_under_capture
from truefuse.ops._launch.dtensor import refuse_dtensor
from truefuse.ops._launch.triton import PLAIN_TENSORS as _PLAIN_TYPES
from truefuse.ops.gemm.activation import check_activation

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class Checked(NamedTuple):
    """What :func:`validate` found.

    Attributes:
        out_shape: the output's shape.
        out_dtype: the output's dtype.
        splits: ``m_splits`` as a list of Python ints, or None.
        rows_mode: grouped by rows of ``a`` (``b`` 3-D), not along the contraction.
        plain: the common call, plainly valid, in eager mode: it may take the kept runner.
    """

    out_shape: tuple[int, ...]
    out_dtype: torch.dtype
    splits: list[int] | None
    rows_mode: bool
    plain: bool


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
        refuse_under_capture(m_splits, "m_splits as a tensor (its sizes are read on the host)")
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


def validate(
    a,
    b,
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
    *,
    refuse_dtensors=True,
) -> Checked:
    """Check every argument of a ``gemm`` call (its keywords, positional here so that the common
    call's check costs little host time), or raise the ``TypeError`` / ``ValueError`` naming the
    argument. ``refuse_dtensors``: a DTensor operand is refused as ``truefuse.gemm`` refuses it,
    after the first step (which takes plain tensors only) and before the general checks.
    ``batch_invariant`` is not among them: the public entries check it where they resolve it
    (``gemm._resolve_batch_invariant``); the internal ones take the bool their caller's mode holds."""
    odt = _plain_out_dtype(
        a, b, out, out_dtype, accumulate, bias, activation, return_pre_activation, grad_bias, grad_activation,
        pre_activation, m_splits,
    )  # fmt: skip
    if odt is not None:
        return Checked((a.shape[0], b.shape[1]), odt, None, False, True)
    if refuse_dtensors:
        refuse_dtensor("gemm", a=a, b=b, out=out, bias=bias, pre_activation=pre_activation, m_splits=m_splits)
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in FLOATS:
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
    return Checked(out_shape, odt, splits, rows_mode, False)


def _plain_out_dtype(
    a, b, out, out_dtype, accumulate, bias, activation, return_pre_activation, grad_bias, grad_activation,
    pre_activation, m_splits,
) -> torch.dtype | None:  # fmt: skip
    """:func:`validate`'s first step: the output dtype of the common call when every argument is
    plainly valid and the call is eager, else None (having raised nothing: the general step then
    checks, and names what is wrong)."""
    if (
        activation is not None
        or return_pre_activation
        or grad_bias
        or grad_activation is not None
        or pre_activation is not None
        or m_splits is not None
        or type(a) not in _PLAIN_TYPES
        or type(b) not in _PLAIN_TYPES
    ):
        return None
    dt, dev = a.dtype, a.device
    if b.dtype is not dt or dt not in FLOATS or a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        return None
    kind = dev.type
    if b.device != dev or kind not in ("cpu", "cuda"):
        return None
    if torch.is_grad_enabled() and (
        a.requires_grad or b.requires_grad or (bias is not None and bias.requires_grad) or (out is not None and out.requires_grad)
    ):
        return None  # the general step refuses it
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
    return odt


def _shares(out: torch.Tensor, t: torch.Tensor) -> bool:
    return t.numel() > 0 and t.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()


def check_out_not_aliased(out: torch.Tensor, **inputs) -> None:
    """Checked inside the op (eager or compiled), where storages have addresses."""
    for name, t in inputs.items():
        if t is not None and t.numel() and out.numel() and t.untyped_storage().data_ptr() == out.untyped_storage().data_ptr():
            raise ValueError(f"out shares memory with {name}; gemm cannot write its result over an input")
