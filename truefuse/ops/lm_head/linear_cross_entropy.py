"""Linear cross-entropy: the reference, argument checks, and the per-chunk math.

Semantics (``linear_cross_entropy_ref``): ``logits = F.linear(input, W, b)`` in fp32, then
``softcap * tanh(logits / softcap)``, then ``F.cross_entropy`` (class ``weight``, ``ignore_index``,
``label_smoothing``, ``reduction`` as torch defines them), plus ``z_loss * logsumexp²`` per
non-ignored token. Reductions of the z-loss term: summed for ``sum``, divided by the number of
non-ignored tokens for ``mean`` (the cross-entropy term of ``mean`` is divided by the summed class
weights of the non-ignored targets, as torch does). When every target is ignored, ``mean`` is 0
with zero gradients, not NaN (torch gives NaN): a documented difference. An ignored token's
z-loss term is selected away (``torch.where``), not multiplied by 0, so that an inf or NaN in its
logits stays out of the loss, as in ``F.cross_entropy``.

Non-finite logits: torch's own behaviour, which the fused op matches. ``F.cross_entropy``'s
log_softmax is NaN on a whole row whose max is ±inf or that holds a NaN, so such a token's loss
and d_logits are NaN; an ignored token's d_logits are 0 − exp(log_softmax)·0 there, NaN too.
``torch.logsumexp`` (the z-loss) gives ±inf for a ±inf max; ``torch.argmax`` (the accuracy) takes
the first NaN, else the first maximum.

:class:`LinearCrossEntropyOptions` holds the options once (checked when built); the per-chunk math
over the chunked LM head is ``ops/lm_head/linear_cross_entropy_chunk.py``.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import operator
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from truefuse.ops._launch.capture import host_may_wait
from truefuse.ops._launch.custom_op import custom_op, launch
from truefuse.ops._launch.dtypes import wide_dtype
from truefuse.ops._launch.triton import triton_runs

REDUCTIONS = ("mean", "sum", "none")
MEMORY_MODES = ("default", "lean")


class LinearCrossEntropyOutput(NamedTuple):
    """What ``linear_cross_entropy`` returns when asked for more than the loss.

    Attributes:
        loss: the loss (0-dim, or shaped like ``target`` for ``reduction="none"``).
        z_loss: the z-loss term alone, reduced like the loss (None unless ``return_z_loss``).
        token_accuracy: fraction of non-ignored tokens whose argmax logit is the target, 0-dim
            (None unless ``return_token_accuracy``; 0 when every target is ignored).
        predicted_tokens: each token's argmax logit (after softcap), int64 shaped like ``target``,
            as ``torch.argmax``: the lowest index among ties, the first NaN in a row that holds
            one; ignored tokens get theirs too (None unless ``return_predicted_tokens``).
    """

    loss: torch.Tensor
    z_loss: torch.Tensor | None
    token_accuracy: torch.Tensor | None
    predicted_tokens: torch.Tensor | None = None


@dataclass(frozen=True)
class LinearCrossEntropyOptions:
    """The loss's options, held once and checked when built (``ValueError`` naming the option).

    Attributes:
        reduction: ``mean`` | ``sum`` | ``none``.
        ignore_index: targets equal to it do not count; None (the default of torch's
            ``F.linear_cross_entropy``) means -100, as torch maps it for class-index targets.
        label_smoothing: in [0, 1]. z_loss: ≥ 0, finite. softcap: > 0, finite, or None.
        return_z_loss, return_token_accuracy: also return those (not differentiable).
        chunk_size: tokens per chunk (a positive int), or None for ``chunked_head.default_chunk``.
        fp32_weight_grad: accumulate the weight gradient across chunks in fp32 (round once).
        memory: ``default`` (token chunks, the fp32 V×H weight-gradient accumulator when
            chunked) | ``lean`` (two passes over slices of the vocabulary, no V×H buffer, one
            more logits GEMM; ``ops/lm_head/linear_cross_entropy_slices.py``). Both bounded, not bitwise
            equal to each other.
        vocab_slice: classes per vocabulary slice under ``lean`` (a positive int), or None for
            ``linear_cross_entropy_slices.default_slice_width``; ignored by ``default``.
        return_predicted_tokens: also return each token's argmax (from the loss kernel's pass
            over the logits; not differentiable).
    """

    reduction: str = "mean"
    ignore_index: int | None = None  # torch's default: -100 (__post_init__)
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    softcap: float | None = None
    return_z_loss: bool = False
    return_token_accuracy: bool = False
    return_predicted_tokens: bool = False
    chunk_size: int | None = None
    fp32_weight_grad: bool = True
    memory: str = "default"
    vocab_slice: int | None = None

    def __post_init__(self):
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}")
        # written so that NaN fails each test (every comparison with NaN is false), and inf is named
        if not 0.0 <= float(self.label_smoothing) <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1], got {self.label_smoothing}")
        if not 0.0 <= float(self.z_loss) < math.inf:
            raise ValueError(f"z_loss must be non-negative and finite, got {self.z_loss}")
        if self.softcap is not None and not 0.0 < float(self.softcap) < math.inf:
            raise ValueError(f"softcap must be positive and finite, or None, got {self.softcap}")
        chunk = self.chunk_size
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"chunk_size must be a positive int or None, got {chunk!r}")
        if self.memory not in MEMORY_MODES:
            raise ValueError(f"memory must be one of {MEMORY_MODES}, got {self.memory!r}")
        vs = self.vocab_slice
        if vs is not None and (isinstance(vs, bool) or not isinstance(vs, int) or vs < 1):
            raise ValueError(f"vocab_slice must be a positive int or None, got {vs!r}")
        if self.ignore_index is None:  # torch's F.linear_cross_entropy: None is -100 for class indices
            object.__setattr__(self, "ignore_index", -100)
        try:
            object.__setattr__(self, "ignore_index", operator.index(self.ignore_index))
        except TypeError:
            raise TypeError(f"ignore_index must be an int or None, got {type(self.ignore_index).__name__}") from None
        # the kernels take Python scalars: one conversion here, not one per use
        for name, kind in (("label_smoothing", float), ("z_loss", float)):
            object.__setattr__(self, name, kind(getattr(self, name)))
        for name in ("return_z_loss", "return_token_accuracy", "fp32_weight_grad", "return_predicted_tokens"):
            object.__setattr__(self, name, bool(getattr(self, name)))
        if self.softcap is not None:
            object.__setattr__(self, "softcap", float(self.softcap))

    @property
    def extras(self) -> bool:
        """Whether the result is a :class:`LinearCrossEntropyOutput` rather than the loss alone."""
        return self.return_z_loss or self.return_token_accuracy or self.return_predicted_tokens


def chunk_size_from(options, chunk_size: int | None) -> int | None:
    """truefuse's ``chunk_size`` given torch's ``options=`` too (``torch.nn.LinearCrossEntropyOptions``
    or None, as ``F.linear_cross_entropy`` takes it): its ``batch_chunk_size`` (rows per chunk) is
    truefuse's ``chunk_size``; its other fields choose how torch's own chunked path runs (heuristic,
    accumulation policy, ``allow_retain_graph``) and change nothing here: truefuse always takes
    the accurate path (fp32 accumulation) and allows ``retain_graph``."""
    if options is None:
        return chunk_size
    if not hasattr(options, "batch_chunk_size"):
        raise TypeError(f"options must be a torch.nn.LinearCrossEntropyOptions or None, got {type(options).__name__}")
    rows = options.batch_chunk_size
    if rows is not None and chunk_size is not None and rows != chunk_size:
        raise ValueError(f"chunk_size={chunk_size} contradicts options.batch_chunk_size={rows} (pass one of them)")
    return chunk_size if rows is None else rows


def check_args(input, linear_weight, target, linear_bias, weight):
    """Clear errors naming the argument, before anything runs (the options are checked by
    :class:`LinearCrossEntropyOptions`; targets against V by :func:`check_targets`)."""
    for name, t in (("input", input), ("linear_weight", linear_weight), ("target", target)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if input.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise TypeError(f"input has dtype {input.dtype}; expected a float dtype")
    if linear_weight.dtype != input.dtype:
        raise TypeError(f"linear_weight has dtype {linear_weight.dtype} but input has {input.dtype}")
    if input.dim() < 1:
        raise ValueError("input must have a last (hidden) dimension: shape (..., H)")
    if linear_weight.dim() != 2 or linear_weight.shape[1] != input.shape[-1]:
        raise ValueError(
            f"linear_weight must be (V, H) with H = input.shape[-1] = {input.shape[-1]}, got {tuple(linear_weight.shape)}"
        )
    V = linear_weight.shape[0]
    if V == 0:
        raise ValueError("linear_weight has no rows: V = 0 classes")
    if target.dtype not in (torch.int64, torch.int32):
        # torch's F.cross_entropy also takes class probabilities (a float target): not supported here
        raise TypeError(f"target must hold class indices (int64 or int32; no class probabilities), got {target.dtype}")
    if tuple(target.shape) != tuple(input.shape[:-1]):
        raise ValueError(f"target has shape {tuple(target.shape)} but input's leading dimensions are {tuple(input.shape[:-1])}")
    for name, t in (("linear_bias", linear_bias), ("weight", weight)):
        if t is not None:
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != (V,):
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name} must have shape ({V},) (one per class), got {got}")
    if linear_bias is not None and linear_bias.dtype != input.dtype:
        raise TypeError(f"linear_bias has dtype {linear_bias.dtype} but input has {input.dtype}")
    for name, t in (("linear_weight", linear_weight), ("target", target), ("linear_bias", linear_bias), ("weight", weight)):
        if t is not None and t.device != input.device:
            raise ValueError(f"{name} is on {t.device} but input is on {input.device}")


def check_targets(target: torch.Tensor, V: int, ignore_index: int, valid: torch.Tensor | None = None):
    """Start checking that no target is ≥ V or negative other than ``ignore_index``; returns the
    callable that finishes the check (``ValueError`` naming the first bad value).

    On CUDA the flag is computed and copied to pinned host memory on the stream, behind an event:
    the callable waits for that event only (work queued after it keeps the GPU busy), not for the
    stream. A full sync there left the GPU idle 0.25 / 0.44 ms a step at 8192 × 32000 / 128256 ×
    4096 (H200). Call it before anything indexes with the targets (the Triton loss kernel reads
    a bad one as column 0, so it may run first)."""
    if not torch.compiler.is_compiling() and _CHECKED_BY_CALLER.get():  # the caller's earlier check
        # covers these targets: no kernels, no wait (dynamo cannot trace ContextVar.get: torch 2.11)
        return _nothing
    if valid is None:  # ``target != ignore_index``, when the caller has it already
        valid = target != ignore_index
    bad = valid & (target.clamp(0, V - 1) != target)  # three kernels: each launch counts here
    return _check_finish(bad.any(), target, V, ignore_index)


#: set by :func:`targets_checked`: the caller started its own :func:`check_targets` earlier
_CHECKED_BY_CALLER = contextvars.ContextVar("truefuse_targets_checked", default=False)


@contextlib.contextmanager
def targets_checked():
    """Within it, the losses do not wait for their own target check: the caller started
    :func:`check_targets` on the same targets earlier (the Hugging Face forward does, before the
    decoder runs) and calls its finish after the loss. Why: waiting on the loss's own check, queued
    right before the loss, stops the host until the GPU has run the whole decoder forward; where the
    host is the bottleneck (a step under FSDP2), the backward's launches then start from an empty
    queue (2 H100s, the demo's GPU model: 218 against 202 ms a step; docs/benchmarks.md, FSDP2)."""
    token = _CHECKED_BY_CALLER.set(True)
    try:
        yield
    finally:
        _CHECKED_BY_CALLER.reset(token)


def _check_finish(flag: torch.Tensor, target: torch.Tensor, V: int, ignore_index: int):
    """:func:`check_targets`' callable from ``flag``, a 0-dim device tensor, nonzero when a target
    is bad (copied to pinned memory behind an event on CUDA; the first bad value is looked up only
    then). Under :func:`targets_checked`: nothing (the caller's check covers it)."""
    if not host_may_wait(target):
        # a traced graph or a CUDA-graph capture cannot wait on the host: the check stays on the
        # device (an async error with no value named; on the CPU it still raises before the return).
        # First: dynamo cannot trace ContextVar.get (torch 2.11), and no caller checks ahead here
        torch._assert_async(flag == 0, f"target outside [0, {V}) and not ignore_index={ignore_index}")
        return _nothing
    if _CHECKED_BY_CALLER.get():
        return _nothing
    if not target.is_cuda:
        any_bad = bool(flag)
        ready = None
    else:
        any_bad = torch.empty((), dtype=flag.dtype, pin_memory=True)
        any_bad.copy_(flag, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()

    def finish() -> None:
        if ready is not None:
            ready.synchronize()
        if bool(any_bad):
            bad = (target != ignore_index) & (target.clamp(0, V - 1) != target)
            first = target[bad][0].item()
            raise ValueError(f"target holds {first}, outside [0, {V}) and not ignore_index={ignore_index}")

    return finish


def _nothing() -> None:
    return None


def target_prologue(t: torch.Tensor, V: int, ignore_index: int, reduction: str, cw: torch.Tensor | None, like: torch.Tensor):
    """What a loss needs from its targets before its chunks: ``(n, s_ce, s_z, finish)``: the
    :func:`valid_count`, the :func:`reduction_scales` and :func:`check_targets`' callable.

    Where the Triton kernels run, in fp32, without class weights and outside torch.compile, one
    kernel computes them all (``kernels/linear_cross_entropy.py``: ``_lce_targets_kernel``, the same
    bits) instead of ten small PyTorch kernels (the mask, the count, its clamp and cast, the
    reciprocal, the target check's four): each launch sits between the GEMMs of a step
    (docs/log/benchmarks_2026-11.md, 8192 × 32000 × 4096). Elsewhere: those functions."""
    wide = wide_dtype(like)
    if cw is not None or wide != torch.float32 or not triton_runs(like) or torch.compiler.is_compiling():
        valid = t != ignore_index
        n = valid_count(valid, wide)
        s_ce, s_z = reduction_scales(reduction, n, t, cw, ignore_index, like)
        return n, s_ce, s_z, check_targets(t, V, ignore_index, valid)
    out = torch.empty(4, dtype=torch.float32, device=like.device)  # n, 1/n, 1, bad
    launch(lce_targets_op, t, out, V, ignore_index)
    s = out[1] if reduction == "mean" else out[2]
    return out[0], s, s, _check_finish(out[3], t, V, ignore_index)


@custom_op("truefuse::lce_targets", mutates_args=("out",))
def lce_targets_op(t: torch.Tensor, out: torch.Tensor, V: int, ignore_index: int) -> None:
    """The launch of :func:`target_prologue`'s kernel as a custom op (docs/design.md §6.7): writes
    ``out`` = [n, 1/n, 1, bad] (fp32)."""
    from truefuse.kernels.linear_cross_entropy import _lce_targets_kernel

    # one program: 9.5 us at 8192 targets (H200), against ~25 us for the ten PyTorch kernels
    block = 1024 if t.is_cuda else 64
    _lce_targets_kernel[(1,)](t, out, t.shape[0], V, ignore_index, BLOCK=block, num_warps=4 if t.is_cuda else 1)


@lce_targets_op.register_fake
def _(t, out, V, ignore_index):
    return None


def target_weights(t: torch.Tensor, cw: torch.Tensor | None, ignore_index: int, dtype: torch.dtype):
    """``(valid, w_t)``: which tokens count, and each token's class weight (0 where ignored)."""
    valid = t != ignore_index
    if cw is None:
        return valid, valid.to(dtype)
    # clamped: this may run before check_targets (which the caller defers past its first GEMM)
    w_t = cw[torch.where(valid, t, 0).clamp(0, cw.shape[0] - 1)].to(dtype)
    return valid, w_t * valid


def valid_count(valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The number of tokens that count, as a divisor: at least 1. When none counts every term it
    divides is 0, so ``mean`` gives 0 (not NaN), zero gradients, and an accuracy of 0."""
    return valid.sum().clamp(min=1).to(dtype)


def mean_scales(n: torch.Tensor, w_t: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``mean``'s scales of the cross-entropy and z-loss terms: 1 / Σ w_t and 1 / n (``n`` from
    :func:`valid_count`). Without class weights (``w_t`` None) Σ w_t is the count: one scale serves
    both. Device tensors: no host sync."""
    s_z = torch.reciprocal(n)
    if w_t is None:
        return s_z, s_z
    denom = w_t.sum()
    return torch.where(denom > 0, 1 / torch.where(denom > 0, denom, 1), 0), s_z


def reduction_scales(reduction: str, n, t, cw, ignore_index: int, like: torch.Tensor):
    """The scales of the cross-entropy and z-loss gradients for ``reduction`` before any upstream
    gradient: :func:`mean_scales` for ``mean``, else 1 (0-dim, in ``like``'s wide dtype)."""
    wide = wide_dtype(like)
    if reduction == "mean":
        return mean_scales(n, None if cw is None else target_weights(t, cw, ignore_index, wide)[1])
    one = torch.ones((), dtype=wide, device=like.device)
    return one, one


def upstream_scales(reduction: str, g_loss: torch.Tensor, s_ce, s_z, like: torch.Tensor, copy: bool):
    """The backward's scales: the forward's times ``grad_output`` (0-dim), or for ``none`` the
    per-token upstream itself, (N,) in ``like``'s wide dtype. ``copy``: a copy of it even when no
    conversion is needed (a delayed weight gradient reads it after the backward returned, when the
    caller may have written its upstream tensor)."""
    if reduction != "none":
        g = g_loss.to(s_ce.dtype)
        return s_ce * g, s_z * g
    s = g_loss.reshape(-1).to(wide_dtype(like), copy=copy)
    return s, s


def token_accuracy(correct: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Fraction of the tokens that count marked ``correct`` (which must be False where a token does
    not count), over ``n`` from :func:`valid_count`; computed in fp32."""
    return correct.sum() / n.float()


def reduce_terms(ce, zl, reduction, scales, with_z: bool = True):
    """(loss, z part) from per-token terms; ``scales``: :func:`mean_scales`' pair, read for ``mean`` only.
    ``with_z=False`` (z_loss 0 and the z part not asked for): the loss without the z-loss term and
    None for the z part; three kernels less. The term is then 0, or NaN on a row whose lse is not
    finite, where the cross-entropy is NaN too: the same loss."""
    if not with_z:
        if reduction == "none":
            return ce, None
        return (ce.sum() if reduction == "sum" else ce.sum() * scales[0]), None
    if reduction == "none":
        return ce + zl, zl
    if reduction == "sum":
        return ce.sum() + zl.sum(), zl.sum()
    s_ce, s_z = scales
    z_m = zl.sum() * s_z
    return ce.sum() * s_ce + z_m, z_m


def _from_logits(
    logits,
    target,
    *,
    weight,
    reduction,
    ignore_index,
    label_smoothing,
    z_loss,
    softcap,
    return_z_loss,
    return_token_accuracy,
    return_predicted_tokens=False,
):
    wide = logits.dtype
    t = target.reshape(-1)
    ignore_index = -100 if ignore_index is None else ignore_index  # torch's F.linear_cross_entropy's None
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    cw = None if weight is None else weight.to(wide)
    ce = F.cross_entropy(logits, t, weight=cw, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing)
    valid, w_t = target_weights(t, cw, ignore_index, wide)
    n = valid_count(valid, wide)
    # selected, not multiplied by the mask: an ignored row's logits never reach the loss (as in
    # F.cross_entropy), so an inf or NaN there leaves it finite
    zl = torch.where(valid, z_loss * torch.logsumexp(logits, dim=-1).square(), 0.0)
    loss, z_part = reduce_terms(ce, zl, reduction, mean_scales(n, None if cw is None else w_t) if reduction == "mean" else None)
    if reduction == "none":
        loss, z_part = loss.view(target.shape), z_part.view(target.shape)
    if not (return_z_loss or return_token_accuracy or return_predicted_tokens):
        return loss
    pred = logits.argmax(-1)
    acc = token_accuracy((pred == t) & valid, n).to(wide) if return_token_accuracy else None
    pred = pred.view(target.shape) if return_predicted_tokens else None
    return LinearCrossEntropyOutput(loss, z_part if return_z_loss else None, acc, pred)


def linear_cross_entropy_ref(
    input: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    *,
    linear_bias: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    reduction: str = "mean",
    ignore_index: int | None = None,
    label_smoothing: float = 0.0,
    options=None,
    z_loss: float = 0.0,
    softcap: float | None = None,
    return_z_loss: bool = False,
    return_token_accuracy: bool = False,
    return_predicted_tokens: bool = False,
    chunk_size: int | None = None,
    memory: str = "default",
    vocab_slice: int | None = None,
):
    """The unfused composition in plain PyTorch, fp32 math (fp64 on fp64 inputs): ``F.linear`` in
    that precision, then the cross-entropy; the semantics ``truefuse.linear_cross_entropy`` must
    match. Materializes the (tokens, V) logits. ``options``, ``chunk_size``, ``memory`` and
    ``vocab_slice`` (how the fused op runs) are accepted and ignored."""
    wide = wide_dtype(input)
    x = input.reshape(-1, input.shape[-1]).to(wide)
    logits = F.linear(x, linear_weight.to(wide), None if linear_bias is None else linear_bias.to(wide))
    return _from_logits(
        logits,
        target,
        weight=weight,
        reduction=reduction,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        softcap=softcap,
        return_z_loss=return_z_loss,
        return_token_accuracy=return_token_accuracy,
        return_predicted_tokens=return_predicted_tokens,
    )


def linear_cross_entropy_plain(input, linear_weight, target, *, linear_bias=None, **kw):
    """What a user writes without us: ``F.linear`` in the input's dtype, the cross-entropy in fp32
    (the bounded contract's same-dtype baseline). Same keywords as the reference."""
    for how in ("options", "chunk_size", "memory", "vocab_slice"):  # how the fused op runs: nothing to do here
        kw.pop(how, None)
    logits = F.linear(input.reshape(-1, input.shape[-1]), linear_weight, linear_bias).to(wide_dtype(input))
    return _from_logits(
        logits,
        target,
        **{
            "weight": None,
            "reduction": "mean",
            "ignore_index": -100,
            "label_smoothing": 0.0,
            "z_loss": 0.0,
            "softcap": None,
            "return_z_loss": False,
            "return_token_accuracy": False,
            **kw,
        },
    )
