"""``LinearFunction``: ``act(x @ Wᵀ + b)`` through ``truefuse.gemm``, with the weight gradient
handed to the docs/design.md §2 contract (``_wgrad.deliver_weight_grad``).

Every linear-family module is built from this Function (plus the norm and gated-activation
Functions), so one code path decides what a weight's backward returns.
"""

from __future__ import annotations

import torch

from truefuse.autograd._autocast import autocast_disabled, autocast_dtype, cast
from truefuse.autograd._double_backward import module_names, refuses_double_backward
from truefuse.autograd._modes import Modes
from truefuse.autograd._wgrad import WgradState, deliver_weight_grad
from truefuse.ops._launch.dtypes import wgrad_dtype
from truefuse.ops._launch.triton import PLAIN_TENSORS as _PLAIN
from truefuse.ops.gemm.activation import activation_grad_ref
from truefuse.ops.gemm.bias_grad import split_bias_grad
from truefuse.ops.gemm.gemm import checked_plain_gemm, gemm, plain_gemm
from truefuse.ops.gemm.gemm_checks import FLOATS
from truefuse.ops.gemm.gemm_kept import kept_linear, kept_linear_hit, kept_product


class LinearFunction(torch.autograd.Function):
    """x (M, K) @ weight (N, K)ᵀ + bias (N,), then an optional activation (its pre-activation is saved).

    Backward: ``d = dy * act'(pre)`` (ATen's backward op), ``dx = d @ W``, bias-gradient
    ``Σ_tokens d`` in fp32 rounded once (always returned normally, also under delay), and the weight
    gradient ``dᵀ @ x`` through :func:`deliver_weight_grad`. ``dtype``: the autocast dtype the
    weight and bias are cast to for the GEMMs (None outside autocast); the gradients come back in
    the parameters' dtypes.
    """

    @staticmethod
    @autocast_disabled
    def forward(ctx, x, weight, bias, activation, state: WgradState, weight_name: str, dtype):
        # under autocast (``dtype`` set) the GEMMs take the weight and bias cast as torch's autocast
        # casts F.linear's; x arrives cast (``linear``). The parameters stay for the backward (§2).
        w, b = cast(weight, dtype), cast(bias, dtype)
        # batch-invariant mode: the forward's, for the backward too (docs/design.md §1)
        ctx.modes = modes = Modes.now()
        bi = modes.batch_invariant
        pre = None
        if activation is None:
            out = plain_gemm(x, w.t(), b, batch_invariant=bi)
        else:
            out, pre, _ = gemm(x, w.t(), bias=b, activation=activation, return_pre_activation=True, batch_invariant=bi)
        ctx.save_for_backward(x, w, pre, weight)
        ctx.activation, ctx.state, ctx.weight_name = activation, state, weight_name
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    @autocast_disabled
    @refuses_double_backward(lambda ctx: module_names(ctx.state.owner, "Linear"))
    def backward(ctx, dy):
        x, w, pre, weight = ctx.saved_tensors
        d = dy if ctx.activation is None else activation_grad_ref(dy, pre, ctx.activation)
        dx = plain_gemm(d, w, batch_invariant=ctx.modes.batch_invariant) if ctx.needs_input_grad[0] else None
        db = None
        if ctx.needs_input_grad[2]:
            # docs/design.md §3's split bias-gradient formula, the same whatever the backends fuse
            db = split_bias_grad(d, ctx.bias_dtype)
        dw = None
        if ctx.needs_input_grad[1]:
            dw = deliver_weight_grad(weight, ctx.weight_name, _wgrad_compute(d, x, weight, plain_gemm), ctx.state)
        return dx, dw, db, None, None, None, None


def _wgrad_compute(d: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, product):
    """The weight-gradient GEMM ``dᵀ @ x`` that :func:`deliver_weight_grad` runs (§2's
    ``WgradCompute``), ``product(a, b, out_dtype=)`` the call for a fresh gradient."""

    @torch.no_grad()  # under delay it runs after the backward, from backward_dw(), on saved x
    def compute(out, accumulate):
        # batch_invariant=False: a weight gradient sums over the tokens, so no row of it belongs
        # to one token; what batch-invariant mode asks of it is the same bits run to run,
        # which the fast plan gives (cuBLAS / CPU BLAS: one fixed algorithm per shape, no
        # atomics; docs/design.md §1)
        if out is None:
            # in the parameter's dtype: an fp32 weight under autocast gets the fp32 GEMM
            # result of the cast operands, rounded once (_autocast.wgrad_dtype)
            g = product(d.t(), x, out_dtype=wgrad_dtype(x.dtype, weight.dtype), batch_invariant=False)
            return g if g.dtype is weight.dtype else g.to(weight.dtype)
        return gemm(d.t(), x, out=out, accumulate=accumulate, batch_invariant=False)

    return compute


def _checked_product(a, b, *, out_dtype, batch_invariant):
    return checked_plain_gemm(a, b, None, out_dtype, batch_invariant)


class _PlainLinearFunction(torch.autograd.Function):
    """:class:`LinearFunction` for its commonest call: no activation, no autocast, x, weight and bias
    plain tensors of one dtype and device (:func:`_plain_call`). The same GEMM calls on the same
    operands in the same mode, the weight gradient through the same §2 delivery, so the same bits
    and contract (``tests/test_bi_host.py``), without the general Function's steps that do nothing
    here: autocast casts and scopes in the forward and the GEMMs' argument checks. A batch-invariant model
    routes every ``F.linear`` here: ~770 µs of host a forward + backward at 8192 × 2048² on an
    H100 host against stock's ~200 (experiments/host_time.py bi-linear), which a host-bound BI
    training step pays 7 times a decoder layer."""

    @staticmethod
    def forward(ctx, x, weight, bias, state: WgradState, weight_name: str):
        ctx.modes = modes = Modes.now()
        bi = modes.batch_invariant
        ctx.save_for_backward(x, weight)
        ctx.state, ctx.weight_name = state, weight_name
        ctx.bias_dtype = None if bias is None else bias.dtype
        return kept_product(x, weight.t(), bias, bi)  # checked_plain_gemm's, kept in BI mode (ops/gemm/gemm_kept.py)

    @staticmethod
    @autocast_disabled  # as LinearFunction's: torch.mm of the weight gradient not autocast
    @refuses_double_backward(lambda ctx: module_names(ctx.state.owner, "Linear"))
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = kept_product(dy, weight, None, ctx.modes.batch_invariant) if ctx.needs_input_grad[0] else None
        db = split_bias_grad(dy, ctx.bias_dtype) if ctx.needs_input_grad[2] else None
        dw = None
        if ctx.needs_input_grad[1]:
            compute = _wgrad_compute(dy, x, weight, _checked_product)
            dw = deliver_weight_grad(weight, ctx.weight_name, compute, ctx.state)
        return dx, dw, db, None, None


def _plain_call(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether :class:`_PlainLinearFunction` computes this call (else :class:`LinearFunction`): what
    ``checked_plain_gemm`` asks its callers to have checked."""
    if type(x2) not in _PLAIN or type(weight) not in _PLAIN or torch.compiler.is_compiling():
        return False
    dt, dev = x2.dtype, x2.device
    if weight.dtype is not dt or dt not in FLOATS or weight.dim() != 2 or weight.device != dev:
        return False
    if dev.type not in ("cpu", "cuda") or x2.shape[1] != weight.shape[1]:
        return False
    return bias is None or (type(bias) in _PLAIN and bias.dtype is dt and bias.device == dev and bias.shape == weight.shape[:1])


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    activation: str | None = None,
    state: WgradState,
    weight_name: str = "weight",
) -> torch.Tensor:
    """Apply :class:`LinearFunction` to ``x`` (..., K), flattened to 2-D once; returns (..., N).

    Under ``torch.autocast`` the GEMMs run in the autocast dtype, as ``F.linear``'s do there
    (``_autocast``): ``x`` is cast here, differentiably, the weight and bias inside the Function."""
    dtype = autocast_dtype(x.device)
    if dtype is not None and x.dtype is dtype and weight.dtype is dtype and (bias is None or bias.dtype is dtype):
        # autocast casts nothing here (a bf16 model under bf16 autocast: TRL's and the Trainer's
        # default): the plain paths below, whose GEMMs write through out= forms autocast never
        # casts, compute what LinearFunction would, without its casts and autocast scopes (~60 µs
        # of host a routed bf16 forward + backward on the 2-core CPU box, 64 x 64 weight)
        dtype = None
    bi = Modes.now().batch_invariant
    if activation is None and dtype is None:
        y = kept_linear(x, weight, bias, bi)  # batch-invariant decode: one kept launch (ops/gemm/gemm_kept.py)
        if y is not None:
            return y
    x = cast(x, dtype)
    x2 = x.reshape(-1, x.shape[-1])
    if activation is None and dtype is None and not _records_graph(x, weight, bias):
        # nothing to differentiate (``generate``, eval): the Function's forward GEMM itself, without
        # the Function (~40 µs of host time a call on the 2-core CI box, where a decode-sized
        # kernel takes ~15 µs on an H100; experiments/host_time.py bi-stubbed). Same call, same bits
        y = plain_gemm(x2, weight.t(), bias, batch_invariant=bi)
    elif activation is None and dtype is None and _plain_call(x2, weight, bias):
        y = _PlainLinearFunction.apply(x2, weight, bias, state, weight_name)
    else:
        y = LinearFunction.apply(x2, weight, bias, activation, state, weight_name, dtype)
    return y.view(*x.shape[:-1], weight.shape[0])


def linear_kept(x, weight, bias) -> torch.Tensor | None:
    """What :func:`linear` returns for a batch-invariant call its kept launch serves (decode:
    nothing to differentiate, nothing for autocast to cast; ``ops/gemm/gemm_kept.py``), else None,
    having run nothing: the routed ``F.linear``'s first try, before its own checks and calls
    (``integrations/huggingface/batch_invariant.py``; ~9 of its 17 µs on the CPU box, stubbed)."""
    if type(x) not in _PLAIN:
        return None
    dtype = autocast_dtype(x.device)
    if dtype is not None and (
        x.dtype is not dtype or weight.dtype is not dtype or (bias is not None and bias.dtype is not dtype)
    ):
        return None
    return kept_linear_hit(x, weight, bias, Modes.now().batch_invariant)


def _records_graph(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether :class:`LinearFunction` would record a graph (or is traced): grad mode on and an
    operand requiring grad, or torch.compile tracing."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        return True
    return torch.compiler.is_compiling()
