"""Grouped linear layers for mixture-of-experts: ``GroupedLinearFunction`` and ``GroupedMLPFunction``.

Rows of ``x`` are ordered by group; ``splits`` (a list of ints, zero allowed) gives each group's
rows. Weights are either *packed*, one (G, N, K) tensor (and one (G, N) bias), or *per group*, G
tensors (N, K). Packed weights go through ``truefuse.gemm``'s grouped forms (rows mode forward and
input gradient, contraction mode weight gradient into a (G, N, K) output); per-group weights run
exactly the calls ``LinearFunction`` makes for one group, so a per-group GroupedLinear equals one
``truefuse.Linear`` per group bit for bit. Every weight gradient goes through docs/design.md §2
(``_wgrad.deliver_weight_grad``), packed or per group.

Packed weights run on one of three *grouped paths* (``GroupSpec.path``; the modules' ``backend=``
argument; docs/design.md §1 "Grouped GEMM", §3 for why one of them is not a planner backend):
``triton`` (the batch-invariant grouped GEMM of ``ops/grouped_gemm/grouped_gemm.py``, outside the planner: the
groups travel as device offsets, so nothing reads the sizes on the host, forward or backward),
``per_group`` (one planned ``truefuse.gemm`` per group: bits equal to one Linear per group) and
``cublas_grouped`` (the planner's fused grouped product, cuBLAS ``grouped_mm``, where it offers it).
The offsets tensor is passed to ``apply`` after the parameters (optional: made from ``splits``
when missing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from truefuse.autograd._autocast import autocast_disabled, cast
from truefuse.autograd._double_backward import module_names, refuses_double_backward
from truefuse.autograd._modes import Modes
from truefuse.autograd._wgrad import WgradState, deliver_weight_grad
from truefuse.ops._launch.custom_op import launch
from truefuse.ops._launch.dtypes import wgrad_dtype
from truefuse.ops.gated_activation.gated_activation import GATED_ACTIVATIONS, gated_activation_ref, gated_fwd_op, use_kernel
from truefuse.ops.gated_activation.gated_recompute import gated_bwd_recompute_op
from truefuse.ops.gemm.activation import activation_ref
from truefuse.ops.gemm.bias_grad import split_bias_grad
from truefuse.ops.gemm.gemm import gemm as _gemm
from truefuse.ops.gemm.gemm import gemm_groups
from truefuse.ops.grouped_gemm.grouped_gemm import grouped_bias_grad, grouped_mm_rows, grouped_mm_wgrad, split_offsets

#: The packed weights' grouped paths: the batch-invariant Triton grouped GEMM, one planned GEMM per
#: group (bits of one Linear per group), the planner's fused grouped product (cuBLAS grouped_mm).
GROUPED_PATHS = ("triton", "per_group", "cublas_grouped")


@dataclass(frozen=True)
class GroupSpec:
    """What a grouped layer's autograd Function needs besides tensors.

    Attributes:
        splits: rows per group (None when they live only in a device tensor: the ``triton`` path).
        packed: one (G, N, K) weight instead of G weights.
        has_bias: biases follow the weights in the parameter list.
        names: weight names for error messages (one, or one per group).
        fused_grouped_gemm: packed weights may use one fused grouped GEMM call (cuBLAS grouped_mm)
            where the planner offers it. Off by default: on the H200 it is not bitwise equal to the
            per-group GEMM a ``Linear`` runs (4096×4096 forward and input gradient differ), and
            the contract says GroupedLinear is.
        dtype: the autocast dtype the weights and biases are cast to for the GEMMs (None outside
            autocast; ``_autocast``); their gradients come back in the parameters' dtypes.
        path: one of :data:`GROUPED_PATHS` for packed weights; None: ``cublas_grouped`` if
            ``fused_grouped_gemm`` else ``per_group`` (what callers that predate it asked for).
            Per-group weights always run the per-group loop.
    """

    splits: tuple[int, ...] | None
    packed: bool
    has_bias: bool
    names: tuple[str, ...]
    fused_grouped_gemm: bool = False
    dtype: torch.dtype | None = None
    path: str | None = None

    def __post_init__(self):
        if self.path is not None and self.path not in GROUPED_PATHS:
            raise ValueError(f"path={self.path!r} is not one of {GROUPED_PATHS}")
        if self.run_path == "triton" and not self.packed:
            raise ValueError("path='triton' needs packed weights (single_grouped_weight=True)")
        if self.splits is None and self.run_path != "triton":
            raise ValueError(f"splits=None (sizes only on the device) needs path='triton', not {self.run_path!r}")

    @property
    def run_path(self) -> str:
        """The grouped path that runs: :attr:`path`, or the one ``fused_grouped_gemm`` names."""
        if not self.packed:
            return "per_group"
        if self.path is not None:
            return self.path
        return "cublas_grouped" if self.fused_grouped_gemm else "per_group"

    @property
    def triton(self) -> bool:
        return self.run_path == "triton"

    def gemm(self, a, b, *, batch_invariant: bool, **kwargs):
        """The packed weights' planned grouped GEMM (``ops.gemm.gemm_groups``), asking for one GEMM
        per group (each exactly Linear's GEMM) unless the path is ``cublas_grouped``."""
        return gemm_groups(a, b, per_group=self.run_path != "cublas_grouped", batch_invariant=batch_invariant, **kwargs)

    def offsets_for(self, offsets, like: torch.Tensor):
        """The device offsets the ``triton`` path needs (given, or made from :attr:`splits`)."""
        if not self.triton:
            return None
        if offsets is not None:
            return offsets
        return split_offsets(list(self.splits), len(self.splits), like.shape[0], like.device)

    def n_params(self) -> int:
        per = 1 if self.packed else len(self.splits)
        return per * (2 if self.has_bias else 1)

    def unpack(self, params) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        per = 1 if self.packed else len(self.splits)
        return list(params[:per]), (list(params[per : 2 * per]) if self.has_bias else None)

    def cast(self, params) -> list[torch.Tensor]:
        """The parameters as the GEMMs take them: cast to :attr:`dtype` under autocast (a copy per
        forward, see ``_autocast``), else themselves."""
        return [cast(p, self.dtype) for p in params]

    def slices(self):
        start = 0
        for m in self.splits:
            yield slice(start, start + m)
            start += m


def grouped_forward(spec: GroupSpec, x, weights, biases, offsets=None, *, bi: bool) -> torch.Tensor:
    """``y[rows of g] = x[rows of g] @ W_gᵀ + b_g``; ``bi``: the forward's batch-invariant mode
    (the ``triton`` path is batch-invariant whatever it is)."""
    if spec.triton:
        return grouped_mm_rows(x, weights[0], offsets, transpose_w=True, bias=None if biases is None else biases[0])
    if spec.packed:
        bias = None if biases is None else biases[0]
        return spec.gemm(x, weights[0].transpose(1, 2), bias=bias, m_splits=list(spec.splits), batch_invariant=bi)
    y = torch.empty((x.shape[0], weights[0].shape[0]), dtype=x.dtype, device=x.device)
    for g, sl in enumerate(spec.slices()):
        y[sl] = _gemm(x[sl], weights[g].t(), bias=None if biases is None else biases[g], batch_invariant=bi)
    return y


def grouped_dgrad(spec: GroupSpec, dy, weights, offsets=None, *, bi: bool) -> torch.Tensor:
    """``dx[rows of g] = dy[rows of g] @ W_g``; ``bi`` as :func:`grouped_forward`."""
    if spec.triton:
        return grouped_mm_rows(dy, weights[0], offsets, transpose_w=False)
    if spec.packed:
        return spec.gemm(dy, weights[0], m_splits=list(spec.splits), batch_invariant=bi)
    dx = torch.empty((dy.shape[0], weights[0].shape[1]), dtype=dy.dtype, device=dy.device)
    for g, sl in enumerate(spec.slices()):
        dx[sl] = _gemm(dy[sl], weights[g], batch_invariant=bi)
    return dx


def grouped_bgrad(spec: GroupSpec, dy, biases, offsets=None) -> list[torch.Tensor]:
    """Per group ``Σ_rows dy`` in fp32 rounded once (docs/design.md §3's split formula, as LinearFunction;
    ``triton``: a fixed-order device segment sum, no host sizes)."""
    if spec.triton:
        return [grouped_bias_grad(dy, offsets, biases[0].dtype)]
    sums = [split_bias_grad(dy[sl], biases[0].dtype) for sl in spec.slices()]
    return [torch.stack(sums)] if spec.packed else sums


def grouped_wgrad(spec: GroupSpec, dy, x, weights, state: WgradState, offsets=None, *, bi: bool) -> list[torch.Tensor | None]:
    """Hand each weight's gradient ``dy_gᵀ @ x_g`` to docs/design.md §2; returns what autograd gets.
    ``bi`` as :func:`grouped_forward`: also for a delayed gradient, computed after the backward."""
    # a new gradient is in the parameter's dtype: under autocast an fp32 weight gets the fp32 GEMM
    # result of the cast operands, rounded once (_autocast.wgrad_dtype)
    odt, pdt = wgrad_dtype(x.dtype, weights[0].dtype), weights[0].dtype
    if spec.triton:

        def compute_t(out, accumulate):
            if out is None:
                return grouped_mm_wgrad(dy, x, offsets, out_dtype=odt).to(pdt)
            return grouped_mm_wgrad(dy, x, offsets, out=out, accumulate=accumulate)

        return [deliver_weight_grad(weights[0], spec.names[0], compute_t, state)]
    if spec.packed:
        splits = list(spec.splits)

        def compute(out, accumulate):
            if out is None:
                return spec.gemm(dy.t(), x, m_splits=splits, out_dtype=odt, batch_invariant=bi).to(pdt)
            return spec.gemm(dy.t(), x, m_splits=splits, out=out, accumulate=accumulate, batch_invariant=bi)

        return [deliver_weight_grad(weights[0], spec.names[0], compute, state)]
    grads = []
    for g, sl in enumerate(spec.slices()):
        dy_g, x_g = dy[sl], x[sl]

        def compute(out, accumulate, dy_g=dy_g, x_g=x_g):
            if out is None:
                return _gemm(dy_g.t(), x_g, out_dtype=odt, batch_invariant=bi).to(pdt)
            return _gemm(dy_g.t(), x_g, out=out, accumulate=accumulate, batch_invariant=bi)

        grads.append(deliver_weight_grad(weights[g], spec.names[g], compute, state))
    return grads


def _param_grads(spec, ctx_needs, offset, dy, x, weights, biases, state, offsets=None, *, bi: bool):
    needs_w = any(ctx_needs[offset : offset + len(weights)])
    wg = grouped_wgrad(spec, dy, x, weights, state, offsets, bi=bi) if needs_w else [None] * len(weights)
    bg = []
    if biases is not None:
        needs_b = any(ctx_needs[offset + len(weights) : offset + 2 * len(weights)])
        bg = grouped_bgrad(spec, dy, biases, offsets) if needs_b else [None] * len(biases)
    return [*wg, *bg]


def _split_offsets_arg(spec: GroupSpec, args, like: torch.Tensor, n: int):
    """(params, offsets, how many tensors follow the parameters): the optional offsets tensor after
    the parameters, or the one the ``triton`` path makes from ``spec.splits``."""
    params, rest = args[:n], args[n:]
    if len(rest) > 1:
        raise TypeError(f"expected {n} parameters and an optional offsets tensor, got {len(args)} tensors")
    return params, spec.offsets_for(rest[0] if rest else None, like), len(rest)


class GroupedLinearFunction(torch.autograd.Function):
    """``apply(x, spec, state, *weights, *biases[, offsets])``: x (M, K) ordered by group -> (M, N).

    ``offsets`` (int64 (G + 1,) device offsets of the groups, ``ops.grouped_gemm.split_offsets``)
    is read by the ``triton`` path only. Under autocast (``spec.dtype``) x arrives cast; the GEMMs
    take the parameters cast likewise, and the backward hands the parameters themselves to
    docs/design.md §2."""

    @staticmethod
    @autocast_disabled
    def forward(ctx, x, spec: GroupSpec, state: WgradState, *args):
        params, offsets, ctx.n_extra = _split_offsets_arg(spec, args, x, spec.n_params())
        ctx.modes = Modes.now()  # batch-invariant mode: the per-group GEMMs', forward and backward
        cw, cb = spec.unpack(spec.cast(params))
        # the parameters (for §2 and their dtypes) and the cast weights (for the input gradient):
        # the same tensors twice outside autocast
        ctx.save_for_backward(x, *params, *cw)
        # the groups' offsets (G + 1 int64, an input, never modified) ride on ctx: the saved
        # activations stay x alone
        ctx.spec, ctx.state, ctx.offsets = spec, state, offsets
        return grouped_forward(spec, x, cw, cb, offsets, bi=ctx.modes.batch_invariant)

    @staticmethod
    @autocast_disabled
    @refuses_double_backward(lambda ctx: module_names(ctx.state.owner, "GroupedLinear"))
    def backward(ctx, dy):
        x, *saved = ctx.saved_tensors
        spec, offsets, bi = ctx.spec, ctx.offsets, ctx.modes.batch_invariant
        params, cw = saved[: spec.n_params()], saved[spec.n_params() :]
        weights, biases = spec.unpack(params)
        dx = grouped_dgrad(spec, dy, cw, offsets, bi=bi) if ctx.needs_input_grad[0] else None
        grads = _param_grads(spec, ctx.needs_input_grad, 3, dy, x, weights, biases, ctx.state, offsets, bi=bi)
        return dx, None, None, *grads, *([None] * ctx.n_extra)


def _act_fwd(h: torch.Tensor, name: str) -> torch.Tensor:
    if use_kernel(h):
        return launch(gated_fwd_op, h, name)
    return gated_activation_ref(h, name) if name in GATED_ACTIVATIONS else activation_ref(h, name)


def _act_bwd(da: torch.Tensor, h: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(dh, a): the activation's input gradient and its output recomputed, in one pass."""
    if use_kernel(h):
        return launch(gated_bwd_recompute_op, da, h, name)
    with torch.enable_grad():
        hh = h.detach().requires_grad_()
        a = _act_fwd(hh, name)
        (dh,) = torch.autograd.grad(a, hh, da)
    return dh, a.detach()


class GroupedMLPFunction(torch.autograd.Function):
    """``apply(x, fc1_spec, fc2_spec, activation, state, *fc1_params, *fc2_params[, offsets])``.

    ``offsets`` as in :class:`GroupedLinearFunction` (both layers share the groups).

    Forward: grouped fc1, activation, grouped fc2. Saved for backward: x and fc1's output only;
    the activation's output (fc2's weight-gradient operand) is recomputed by the same Triton pass
    that takes the activation's backward, which reads fc1's output anyway.
    """

    @staticmethod
    @autocast_disabled
    def forward(ctx, x, spec1: GroupSpec, spec2: GroupSpec, activation: str, state: WgradState, *args):
        n1 = spec1.n_params()
        params, offsets, ctx.n_extra = _split_offsets_arg(spec1, args, x, n1 + spec2.n_params())
        ctx.modes = Modes.now()  # as GroupedLinearFunction
        bi = ctx.modes.batch_invariant
        if offsets is None:
            offsets = spec2.offsets_for(None, x)
        w1, b1 = spec1.unpack(spec1.cast(params[:n1]))  # cast under autocast (x arrives cast)
        w2, b2 = spec2.unpack(spec2.cast(params[n1:]))
        h = grouped_forward(spec1, x, w1, b1, offsets, bi=bi)
        y = grouped_forward(spec2, _act_fwd(h, activation), w2, b2, offsets, bi=bi)
        # the parameters (for §2) and the cast weights (for the input gradients): the same tensors
        # twice outside autocast
        ctx.save_for_backward(x, h, *params, *w1, *w2)
        ctx.offsets = offsets  # as in GroupedLinearFunction: kept, not counted as a saved activation
        ctx.spec1, ctx.spec2, ctx.activation, ctx.state = spec1, spec2, activation, state
        return y

    @staticmethod
    @autocast_disabled
    @refuses_double_backward(lambda ctx: module_names(ctx.state.owner, "GroupedMLP"))
    def backward(ctx, dy):
        x, h, *saved = ctx.saved_tensors
        spec1, spec2, offsets, bi = ctx.spec1, ctx.spec2, ctx.offsets, ctx.modes.batch_invariant
        n1, n = spec1.n_params(), spec1.n_params() + spec2.n_params()
        params = saved[:n]
        w1, b1 = spec1.unpack(params[:n1])
        w2, b2 = spec2.unpack(params[n1:])
        cw1, cw2 = saved[n : n + len(w1)], saved[n + len(w1) :]
        da = grouped_dgrad(spec2, dy, cw2, offsets, bi=bi)
        dh, a = _act_bwd(da, h, ctx.activation)
        del da
        needs = ctx.needs_input_grad
        g2 = _param_grads(spec2, needs, 5 + n1, dy, a, w2, b2, ctx.state, offsets, bi=bi)
        dx = grouped_dgrad(spec1, dh, cw1, offsets, bi=bi) if needs[0] else None
        g1 = _param_grads(spec1, needs, 5, dh, x, w1, b1, ctx.state, offsets, bi=bi)
        return dx, None, None, None, None, *g1, *g2, *([None] * ctx.n_extra)
