"""Mixture-of-experts: stock transformers experts modules on truefuse's grouped GEMMs.

Supported: the experts modules of transformers 5 that keep every expert's weights in two 3-D
parameters (:data:`EXPERT_CLASSES`: ``Qwen3MoeExperts``, ``MixtralExperts``)::

    gate_up_proj (E, 2F, H)   rows [gate (F); up (F)] of each expert, y = x @ W.T
    down_proj    (E, H, F)

That is exactly the packed layout of ``truefuse.GroupedMLP(single_grouped_weight=True)``:
``fc1_weight`` (E, fc1_out, hidden) with halves [gate, up] (``act(first half) * second half``) and
``fc2_weight`` (E, hidden, ffn). So the HF parameters themselves are handed to
``GroupedMLPFunction``: no copy, no view, no transpose, and their gradients land in their own
``.grad`` as autograd gives it (docs/design.md §2's plain configuration).

:func:`patch_experts` swaps one module's class for a subclass (``Truefuse<Stock>``, registered in
this module so that a patched model still pickles) whose ``forward(hidden_states, top_k_index,
top_k_weights)`` runs:

1. the (token, slot) pairs sorted by expert (stable sort of ``top_k_index``) and the per-expert
   counts (``m_splits``), kept on the device for the ``triton`` backend (no host sync: the layer can
   be captured in a CUDA graph), taken to the host otherwise and for expert-parallel modules, whose
   sentinels are dropped by count (see :func:`_route`);
2. ``GroupedMLPFunction``: grouped GEMM with ``gate_up_proj``, the gated activation, grouped GEMM
   with ``down_proj``, on the backend ``patch_experts(backend=...)`` names, as
   ``truefuse.GroupedMLP(single_grouped_weight=True, backend=...)``: by default (None) the
   batch-invariant Triton grouped GEMM on CUDA (``triton``: each expert's rows bitwise independent
   of the other experts' token counts and of the batch), one GEMM per expert elsewhere
   (``per_group``, the CPU); ``cublas_grouped`` (cuBLAS ``grouped_mm``; ``fused_grouped_gemm=True``,
   its older spelling) promises neither;
3. each row times its routing weight, back in (token, slot) order, and the sum over the ``top_k``
   slots with stock's rounding (below).

Rounding, against the stock module in the same dtype:

* The GEMMs: one rounding each, as ``F.linear`` (``per_group``: the call ``truefuse.gemm`` makes;
  ``triton``: fp32 accumulation in truefuse's own tile order, bounded against ``F.linear``, not its
  bits; either can differ from stock's ``F.linear`` / ``grouped_mm`` in the last bits).
* The activation: truefuse's gated activation computes ``act(gate) * up`` in fp32 and rounds once;
  stock rounds ``act(gate)`` to the input dtype and then the product (two roundings in bf16/fp16;
  identical in fp32 up to the last bit). Not followed: it is GroupedMLP's kernel (docs/design.md).
* The routing weights: followed exactly. ``y * top_k_weights`` in torch's promoted dtype (Qwen3-MoE
  casts its weights to the hidden dtype; Mixtral keeps them fp32, so in a bf16 model the product is
  fp32), then as the stock implementation the model was configured with
  (``config._experts_implementation``):

  - ``eager`` (or no config; the class's own loop): each product rounded to the hidden dtype and
    added in the hidden dtype, one expert after the other in increasing expert index
    (``index_add_`` per expert) — reproduced by adding the slots in expert order;
  - ``grouped_mm`` / ``batched_mm`` (transformers 5's default on PyTorch with ``grouped_mm``): the
    slots summed in the product's dtype (``.sum(dim=1)``, fp32 accumulation) and rounded once to
    the hidden dtype.

  Any other implementation (:data:`MAPPED_IMPLEMENTATIONS`: a function registered in transformers'
  ``ExpertsInterface``, ``deepgemm``, ``sonicmoe``), configured or chosen with
  ``model.set_experts_implementation`` after patching, runs as the stock module runs it: truefuse
  steps aside for it, and takes over again when one of the four above is chosen. (So transformers'
  ``test_eager_matches_batched_and_grouped_inference``, which checks that ``batched_mm`` and
  ``grouped_mm`` reach transformers' own functions, fails on a patched model by design: truefuse
  runs them, with their rounding rules.)

  With ``top_k == 2`` and routing weights in the hidden dtype (Qwen3-MoE) both rules give the
  same bits (one rounding of a two-term sum); Mixtral's fp32 weights in a bf16 model do not.

* Expert-parallel sentinels (an index equal to ``num_experts``, which stock skips) are dropped: they
  get no GEMM row and contribute exactly 0. Only a module marked expert-parallel (transformers sets
  ``_is_expert_parallel`` when it shards the experts) may hold them on the ``triton`` backend; an
  unmarked one raises :data:`SENTINEL_MESSAGE` (a device-side assert on CUDA).
* ``torch.autocast``: as the configured stock forward. ``eager`` (``F.linear``) and ``batched_mm``
  (``bmm``) are autocast ops: the input and both weights are cast to the autocast dtype
  (differentiable ``.to``, so the weight gradients are the autocast-dtype GEMM's result brought back
  to the parameters' dtype, as torch's autocast gives them). ``grouped_mm`` is not: stock runs it
  in the weights' dtype, and so does this. Either way the grouped function itself runs with
  autocast off (call the backward outside the autocast region, as torch recommends).

Refused (``patch_experts`` returns a falsy :class:`ExpertsPatch` whose ``reason`` says why, also
given by :func:`unsupported_reason` without patching; the module is left stock): an unknown class,
an activation truefuse has no gated kernel for (``modules.gated_for``: SiLU → ``swiglu``, erf GELU
→ ``geglu``, tanh GELU → ``geglu_tanh``, ReLU → ``reglu``; e.g. ``gelu_new`` is refused), a layout the decorator
``@use_experts_implementation`` marks differently from the one above (``has_bias``,
``is_transposed``, ``is_concatenated=False``, ``has_gate=False``, ``has_post_expert_norm``, a
class-specific ``_apply_gate``), or parameters of unexpected shape.

transformers versions: written against 5.23. The decorator's flags and
``config._experts_implementation`` are read with ``getattr`` and the stock default, so a version that sets
fewer of them (the GPU machine has 5.17; not inspected here) is taken as the layout above with the
eager rounding rule, which is what the class's own forward computes; activation classes absent from
``transformers.activations`` are skipped the same way.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from truefuse.autograd._autocast import autocast_dtype, cast
from truefuse.autograd._modes import Modes
from truefuse.autograd._wgrad import WgradState
from truefuse.autograd.grouped import GroupedMLPFunction, GroupSpec
from truefuse.integrations.huggingface.experts_op import experts_mlp
from truefuse.integrations.huggingface.modules import gated_for, truefuse_subclass
from truefuse.nn.grouped import check_grouped_path, resolve_grouped_path
from truefuse.ops._launch.capture import refuse_under_capture
from truefuse.ops._launch.dtensor import refuse_dtensor
from truefuse.ops.grouped_gemm.grouped_gemm import split_offsets

#: The transformers experts classes :func:`patch_experts` takes (matched by class name, the module's
#: own class or a stock base of it).
EXPERT_CLASSES: tuple[str, ...] = ("Qwen3MoeExperts", "MixtralExperts")

#: ``@use_experts_implementation`` layout flags and the value the layout above needs (the stock
#: default, also assumed when the attribute is absent).
_LAYOUT_FLAGS: dict[str, bool] = {
    "has_gate": True,
    "has_bias": False,
    "is_transposed": False,
    "is_concatenated": True,
    "has_post_expert_norm": False,
}


@dataclass(frozen=True)
class ExpertsPatch:
    """What :func:`patch_experts` did; truthy iff the module now runs truefuse.

    Attributes:
        patched: the module's forward is truefuse's (also true for an already patched module).
        reason: why not, when not patched ("" otherwise).
        activation: truefuse's gated activation used (``swiglu``, ``geglu``, ``geglu_tanh``, ``reglu``) when patched.
    """

    patched: bool
    reason: str = ""
    activation: str | None = None

    def __bool__(self) -> bool:
        return self.patched


def _stock_class(module: torch.nn.Module) -> type | None:
    """The stock experts class of ``module`` (its own class or the stock base of a truefuse one)."""
    cls = getattr(type(module), "_truefuse_stock", type(module))
    return cls if cls.__name__ in EXPERT_CLASSES else None


def _default_apply_gate():
    try:
        from transformers.integrations import moe as hf_moe
    except ImportError:  # transformers without the experts interface: no _apply_gate either
        return None
    return getattr(hf_moe, "_default_apply_gate", None)


def unsupported_reason(module: torch.nn.Module) -> str:
    """Why :func:`patch_experts` would leave ``module`` stock; ``""`` (falsy) when it can take it."""
    return _check(module)[1]


def _check(module: torch.nn.Module) -> tuple[str | None, str]:
    """``(activation, "")`` when :func:`patch_experts` can take ``module``, else ``(None, reason)``."""
    stock = _stock_class(module)
    if stock is None:
        return None, f"{type(module).__name__} is not one of the supported experts classes {EXPERT_CLASSES}"
    for flag, needed in _LAYOUT_FLAGS.items():
        value = getattr(module, flag, needed)
        if bool(value) != needed:
            return None, f"{flag}={value} (truefuse's grouped MLP needs {flag}={needed})"
    gate = vars(stock).get("_apply_gate")
    if gate is not None and gate is not _default_apply_gate():
        return None, "a class-specific _apply_gate (only act(gate) * up is supported)"
    hidden_act = getattr(getattr(module, "config", None), "hidden_act", "?")
    act = gated_for(getattr(module, "act_fn", None))
    if act is None:
        return None, (
            f"activation {type(getattr(module, 'act_fn', None)).__name__} (hidden_act={hidden_act!r}) has no truefuse "
            "gated kernel (silu/swish -> swiglu, gelu -> geglu, gelu_pytorch_tanh -> geglu_tanh, relu -> reglu)"
        )
    w1, w2 = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not isinstance(w1, torch.nn.Parameter) or not isinstance(w2, torch.nn.Parameter):
        return None, "gate_up_proj / down_proj are not parameters"
    E = getattr(module, "num_experts", None)
    if w1.dim() != 3 or w2.dim() != 3 or w1.shape[0] != E or w2.shape[0] != E:
        return None, f"gate_up_proj {tuple(w1.shape)} / down_proj {tuple(w2.shape)} are not (E={E}, ., .) 3-D"
    F2, H = w1.shape[1:]
    if F2 % 2 or tuple(w2.shape[1:]) != (H, F2 // 2):
        return None, f"gate_up_proj {tuple(w1.shape)} and down_proj {tuple(w2.shape)} are not (E, 2F, H) and (E, H, F)"
    if not w1.is_floating_point() or w1.dtype != w2.dtype:
        return None, f"gate_up_proj ({w1.dtype}) and down_proj ({w2.dtype}) must share one floating dtype"
    return act, ""


def _experts_implementation(module: torch.nn.Module) -> str | None:
    """The stock experts implementation the model is configured with (None: no config, or a
    transformers without the switch: the class's own loop runs)."""
    return getattr(getattr(module, "config", None), "_experts_implementation", None)


#: The stock implementations whose results truefuse's grouped MLP reproduces (bounded, with their
#: summation order and autocast rule): ``model.set_experts_implementation`` to one of them keeps a
#: patched module on truefuse (generate() itself switches grouped_mm to batched_mm for decoding on a
#: GPU). Any other (a registered custom function, ``deepgemm``, ``sonicmoe``) runs as stock runs it.
MAPPED_IMPLEMENTATIONS: tuple[str | None, ...] = (None, "eager", "grouped_mm", "batched_mm")


def _eager_rule(module: torch.nn.Module) -> bool:
    """Whether the stock forward the model would run is the class's own per-expert loop."""
    return _experts_implementation(module) in (None, "eager")


#: Raised (on CUDA as a device-side assert) when a module not marked expert-parallel is routed to
#: the sentinel expert ``num_experts``: the device-splits path has no host count to drop it by.
SENTINEL_MESSAGE = (
    "top_k_index holds the expert-parallel sentinel (== num_experts) but this experts module is not marked "
    "expert-parallel (module._is_expert_parallel, set by transformers when it shards the experts)"
)


def _route(module: torch.nn.Module, backend: str, counts: torch.Tensor, order: torch.Tensor):
    """``(splits, rows, extra)`` for ``GroupedMLPFunction``: the group sizes for the host (None: on
    the device), the (token, slot) pairs that get a GEMM row, in expert order, and the device offsets
    to pass after the weights (``()``: made from ``splits``).

    ``triton`` on a module not marked expert-parallel (``_is_expert_parallel``, transformers 5's flag;
    absent: not) keeps the sizes on the device: no host sync, so the layer (router included) can be
    captured in a CUDA graph. Such a module has no sentinels; one would make the offsets sum short
    of the rows, so it is asserted on the device (:data:`SENTINEL_MESSAGE`). Otherwise the sizes come
    to the host (one sync per forward: ~10-50 us per MoE layer on a GPU and the launch-ahead lost) and
    the sentinels' pairs, sorted last, are dropped exactly (no row, no contribution)."""
    E = counts.numel() - 1
    if backend == "triton" and not getattr(module, "_is_expert_parallel", False):
        torch._assert_async(counts[E] == 0, SENTINEL_MESSAGE)
        return None, order, (split_offsets(counts[:E], E, order.numel(), counts.device, check=False),)
    why = "expert-parallel (sentinel slots dropped by a host count)" if backend == "triton" else f"experts_backend={backend!r}"
    refuse_under_capture(counts, f"the experts' group sizes ({why})")
    splits = counts[:E].tolist()
    n = sum(splits)
    return tuple(splits), (order[:n] if n < order.numel() else order), ()


def _exported_rows(module: torch.nn.Module, counts: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """The rows of :func:`_route` while ``torch.export`` traces a host-sizes backend: every pair
    (a module not marked expert-parallel has no sentinel: asserted in the program, as the
    ``triton`` path does). An expert-parallel module is refused: its sentinels are dropped by a
    host count, which the exported program cannot make."""
    if getattr(module, "_is_expert_parallel", False):
        raise NotImplementedError(
            "torch.export of an expert-parallel experts module (_is_expert_parallel) on a host-sizes backend "
            "(per_group / cublas_grouped) is not supported: its sentinel slots are dropped by a host count"
        )
    torch._assert_async(counts[-1] == 0, SENTINEL_MESSAGE)
    return order


def _experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """Stock's ``forward`` on truefuse's grouped MLP.

    Args:
        hidden_states: (T, H) tokens (any leading shape is flattened).
        top_k_index: (T, K) integer expert of each slot (``num_experts``: an expert-parallel
            sentinel, skipped).
        top_k_weights: (T, K) float routing weight of each slot.

    Returns:
        (T, H) in ``hidden_states``' dtype: ``Σ_k top_k_weights[t, k] · expert_{index[t, k]}(x_t)``.
    """
    if _experts_implementation(self) not in MAPPED_IMPLEMENTATIONS:
        # an implementation truefuse does not reproduce, chosen with set_experts_implementation:
        # honoured as the stock module runs it (its forward dispatches on the config), not ignored
        return type(self)._truefuse_stock.forward(self, hidden_states, top_k_index, top_k_weights)
    refuse_dtensor(
        f"GroupedMLP (the patched {getattr(type(self), '_truefuse_stock', type(self)).__name__})",
        hidden_states=hidden_states,
        gate_up_proj=self.gate_up_proj,
        down_proj=self.down_proj,
    )
    shape = hidden_states.shape
    x_all = hidden_states.reshape(-1, shape[-1])
    T, K, E = x_all.shape[0], top_k_index.shape[-1], self.num_experts
    ids = top_k_index.reshape(-1)
    # (token, slot) pairs in expert order; stable, so within an expert by token, then slot
    order = torch.sort(ids, stable=True).indices
    # Per-expert counts without a sync (scatter_add, not bincount, which syncs for its length);
    # sentinels (>= E) counted in the last bin.
    counts = torch.zeros(E + 1, dtype=torch.int64, device=ids.device).scatter_add_(0, ids.clamp(max=E), torch.ones_like(ids))

    eager = _eager_rule(self)
    # torch.autocast as the configured stock forward: F.linear (eager) and bmm (batched_mm) are cast
    # to the autocast dtype; grouped_mm is not an autocast op (stock casts the input to the weights')
    autocast = autocast_dtype(x_all.device)
    dt = autocast if _experts_implementation(self) != "grouped_mm" else None
    w1, w2 = cast(self.gate_up_proj, dt), cast(self.down_proj, dt)
    backend = resolve_grouped_path(getattr(self, "_truefuse_backend", None), x_all.device, dt or w1.dtype, True)
    # torch.export cannot trace the host read of the counts: the same forward as one opaque op
    exporting = backend != "triton" and torch.compiler.is_exporting()
    if exporting:
        rows = _exported_rows(self, counts, order)
    else:
        splits, rows, extra = _route(self, backend, counts, order)
    x = x_all[rows // K]
    x = cast(x, dt) if dt is not None else x.to(w1.dtype)  # stock's grouped_mm casts to the weights' dtype
    with torch.autocast(x.device.type, enabled=False) if autocast is not None else contextlib.nullcontext():
        if exporting:
            y = experts_mlp(x, w1, w2, counts[:E], self._truefuse_activation, backend)
        else:
            spec1 = GroupSpec(splits, True, False, ("gate_up_proj",), path=backend)
            spec2 = GroupSpec(splits, True, False, ("down_proj",), path=backend)
            y = GroupedMLPFunction.apply(x, spec1, spec2, self._truefuse_activation, self._truefuse_wgrad, w1, w2, *extra)

    out_dtype = hidden_states.dtype
    prod = y * top_k_weights.reshape(-1)[rows].unsqueeze(-1)  # torch's promotion, as stock
    if eager:
        prod = prod.to(out_dtype)
    slots = prod.new_zeros(T * K, shape[-1]).index_copy(0, rows, prod).view(T, K, shape[-1])
    if eager:
        # stock: index_add_ one expert after the other into zeros, rounding every add to out_dtype
        if K > 2:  # two terms: one rounding of their sum in any order
            by_expert = torch.sort(top_k_index.reshape(T, K), dim=-1, stable=True).indices
            slots = slots.gather(1, by_expert.unsqueeze(-1).expand_as(slots))
        out = slots[:, 0]
        for k in range(1, K):
            out = out + slots[:, k]
    elif Modes.now().batch_invariant:
        # the slots added in slot order in the product's dtype, rounded once: a fixed order, where
        # .sum(dim=1)'s reduction may be split by the token count
        out = slots[:, 0]
        for k in range(1, K):
            out = out + slots[:, k]
        out = out.to(out_dtype)
    else:
        out = slots.sum(dim=1).to(out_dtype)
    return out.reshape(shape)


def patch_experts(module: torch.nn.Module, *, backend: str | None = None, fused_grouped_gemm: bool = False) -> ExpertsPatch:
    """Run one stock experts module (:data:`EXPERT_CLASSES`) on truefuse's grouped MLP, in place.

    The module keeps its parameters (the same tensors), names, shapes and state_dict keys; its class
    becomes ``Truefuse<Stock>``, a subclass (``isinstance`` against the stock class holds;
    ``truefuse.integrations.huggingface.modules.unpatch`` gives the stock class back).

    Args:
        module: a ``Qwen3MoeExperts`` / ``MixtralExperts`` instance.
        backend: the grouped GEMMs' backend, as ``truefuse.GroupedMLP``'s (the HF weights are packed):
            None (default): ``"triton"`` on CUDA (fp16/bf16/fp32), ``"per_group"`` elsewhere;
            ``"triton"`` (batch-invariant; on the CPU only under ``TRITON_INTERPRET=1`` for fp32),
            ``"per_group"`` (one ``truefuse.gemm`` per expert) or ``"cublas_grouped"``. Resolved at
            each forward from the input's device and dtype.
        fused_grouped_gemm: the older spelling of ``backend="cublas_grouped"``.

    Returns:
        :class:`ExpertsPatch`, truthy iff patched (an already patched module: truthy, unchanged
        except ``backend``); when falsy its ``reason`` says why and the module is untouched.

    Raises:
        ValueError: ``backend`` is not one of ``truefuse.autograd.grouped.GROUPED_PATHS`` or None,
            or conflicts with ``fused_grouped_gemm`` (before anything is checked or patched).
    """
    backend = check_grouped_path(backend, bool(fused_grouped_gemm), True)
    act, reason = _check(module)
    if act is None:
        return ExpertsPatch(False, reason)
    stock = _stock_class(module)
    module._truefuse_activation = act
    module._truefuse_backend = backend
    if getattr(module, "_truefuse_wgrad", None) is None:
        module._truefuse_wgrad = WgradState(owner=stock.__name__)
    module.__class__ = truefuse_subclass(stock, "experts", _experts_forward)
    return ExpertsPatch(True, "", act)


#: The transformers routers :func:`patch_router` takes (by class name): ``F.linear`` logits, softmax,
#: ``torch.topk``, then (Qwen3-MoE: if ``norm_topk_prob``; Mixtral: always) the top-k renormalized.
ROUTER_CLASSES: tuple[str, ...] = ("Qwen3MoeTopKRouter", "MixtralTopKRouter")

#: The routers' logits GEMM: truefuse's Linear in the plain §2 configuration (``.grad``).
_ROUTER_WGRAD = WgradState(owner="router (batch-invariant)")


def _router_forward(self, hidden_states: torch.Tensor):
    """A top-k router whose choice for a token depends on that token alone (batch-invariant mode).

    As stock, except: the logits are computed in fp32 (both operands upcast, on truefuse's Linear:
    the batch-invariant GEMM under the switch), so no bf16 rounding of a logit decides a close
    choice; and ties go to the lowest expert index (a stable descending sort, where ``torch.topk``
    leaves the order of equal values unspecified). Returns stock's ``(logits, scores, indices)``:
    logits in the hidden dtype, scores as stock (Qwen3-MoE: the hidden dtype; Mixtral: fp32).
    """
    from truefuse.autograd.linear import linear

    x = hidden_states.reshape(-1, self.hidden_dim)
    logits = linear(x.float(), self.weight.float(), None, state=_ROUTER_WGRAD)
    probs = torch.softmax(logits, dim=-1)
    values, indices = torch.sort(probs, dim=-1, descending=True, stable=True)
    values, indices = values[:, : self.top_k], indices[:, : self.top_k]
    if getattr(self, "norm_topk_prob", True):  # Mixtral's router always renormalizes
        values = values / values.sum(dim=-1, keepdim=True)
    if self._truefuse_stock.__name__ == "Qwen3MoeTopKRouter":
        values = values.to(x.dtype)  # stock: .to(router_logits.dtype), its logits in the hidden dtype
    return logits.to(x.dtype), values, indices


def find_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every submodule of ``model`` whose (stock) class is in :data:`ROUTER_CLASSES`."""
    return [m for m in model.modules() if getattr(type(m), "_truefuse_stock", type(m)).__name__ in ROUTER_CLASSES]


def patch_router(module: torch.nn.Module) -> None:
    """Give a router of :data:`ROUTER_CLASSES` :func:`_router_forward` (a ``Truefuse<Stock>`` subclass)."""
    stock = getattr(type(module), "_truefuse_stock", type(module))
    module.__class__ = truefuse_subclass(stock, "router_batch_invariant", _router_forward)


def find_experts(model: torch.nn.Module):
    """``(name, module)`` of every submodule of ``model`` whose (stock) class is in :data:`EXPERT_CLASSES`."""
    for name, m in model.named_modules():
        if _stock_class(m) is not None:
            yield name, m
