"""``apply_truefuse``: put a Hugging Face model's norms, MLPs, experts and loss on truefuse.

Modules are found by type (the architecture's classes, ``architectures.py``) over the whole
module tree, checked all first and then patched, so a model is either patched as the report says
or left untouched with an error.
"""

from __future__ import annotations

import torch

from truefuse.integrations.huggingface import batch_invariant as _bi
from truefuse.integrations.huggingface import modules
from truefuse.integrations.huggingface.architectures import ARCHITECTURES, Architecture, architecture_of
from truefuse.integrations.huggingface.class_patch import ClassPatch, apply_truefuse_to
from truefuse.integrations.huggingface.report import PatchReport


def _model_type(model: torch.nn.Module) -> str:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "model_type"):
        raise TypeError(f"apply_truefuse needs a transformers PreTrainedModel (with .config), got {type(model).__name__}")
    return config.model_type


def _refuse_tensor_parallel(model: torch.nn.Module) -> None:
    """A ValueError before anything is patched when a parameter is a DTensor that FSDP2 does not
    manage: a ``tp_plan`` / ``parallelize_module`` shard (issue 35). The fused loss reads
    ``lm_head.weight`` itself, past the TP hooks that would gather its vocabulary shards, and the
    experts their weights (docs/huggingface.md, "Tensor parallelism"). FSDP2's own DTensors (under a
    ``fully_shard`` module, one ``Shard(0)``, replicated on an HSDP mesh's other dimension) are
    plain tensors again when its forward runs: allowed."""
    from truefuse.ops._launch.dtensor import _dtensor_class

    cls = _dtensor_class()
    if cls is None:
        return
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import Replicate, Shard

    fsdp = {id(p) for m in model.modules() if isinstance(m, FSDPModule) for p in m.parameters()}

    def fsdp_only(p) -> bool:  # type(...) is Shard: _StridedShard (FSDP over TP) is a subclass
        shards = [pl for pl in p.placements if not isinstance(pl, Replicate)]
        return id(p) in fsdp and len(shards) == 1 and type(shards[0]) is Shard and shards[0].dim == 0

    for name, p in model.named_parameters():
        if isinstance(p, cls) and not fsdp_only(p):
            raise ValueError(
                f"apply_truefuse does not patch a tensor-parallel model: parameter {name!r} is a DTensor "
                f"(placements {tuple(p.placements)}; a tp_plan or parallelize_module sharded it), and truefuse's "
                "fused loss and experts read their weights past the tensor-parallel hooks. Patch a model "
                "without tensor parallelism (FSDP2's sharded parameters are not refused). Nothing was patched."
            )


def apply_truefuse(
    model: torch.nn.Module,
    *,
    rms_norm: bool = True,
    mlp: bool = True,
    experts: bool = True,
    rope: bool = True,
    linear_cross_entropy: bool = True,
    stock_norm_bits: bool = True,
    experts_backend: str | None = None,
    batch_invariant: bool = False,
    attention: bool | None = None,
    loss_memory: str = "default",
    fuse_residual_norm: bool = False,
    fuse_sibling_grads: bool = False,
) -> PatchReport:
    """Patch an instantiated transformers model in place.

    Args:
        model: a ``*ForCausalLM`` (or its base model) of an architecture in ``ARCHITECTURES``
            (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 text, Qwen3-MoE, Mixtral).
        rms_norm: every RMSNorm runs ``truefuse.rms_norm_hf`` (the stock forward's bits, a fused backward).
        mlp: every dense gated MLP runs its activation and product as one truefuse kernel.
        experts: every mixture-of-experts experts module runs truefuse's grouped GEMMs.
        rope: every attention module's rotary embedding runs ``truefuse.apply_rotary_pos_emb``
            (the stock bits, one kernel each way instead of six ops on strided tensors).
        linear_cross_entropy: with ``labels`` the forward computes ``truefuse.linear_cross_entropy``
            on the last hidden states (the logits are never built); HF's label shift,
            ``ignore_index=-100`` and ``num_items_in_batch`` as HF's loss.
        stock_norm_bits: the norms give the stock forward's bits (default). False: truefuse's
            own ``rms_norm`` (one kernel, one rounding: more accurate, ~2% faster steps on the
            demo's GPU model, not stock's bits).
        experts_backend: the experts' grouped GEMM backend, ``truefuse.GroupedMLP``'s ``backend``
            (``moe.patch_experts``): None (default) the batch-invariant ``"triton"`` kernel on CUDA,
            ``"per_group"`` elsewhere; or ``"triton"``, ``"per_group"``, ``"cublas_grouped"``.
        batch_invariant: the model's forward runs in ``truefuse.batch_invariant()`` mode, its
            ``F.linear`` calls on the batch-invariant GEMM and its routers in fp32 with a fixed
            tie-break (``batch_invariant.py``); ``report.batch_invariant`` lists them.
        attention: the attention modules run ``truefuse.attention`` (``attn_implementation="truefuse"``,
            ``attention.py``: batch-invariant, bounded against SDPA, no attention weights). None
            (default): on with ``batch_invariant=True`` (a batch-invariant model needs it), else
            off, the model keeping the ``attn_implementation`` it was built with.
        loss_memory: the fused loss's ``memory`` (``truefuse.linear_cross_entropy``): ``"default"``
            (chunks of tokens, the weight gradient in an fp32 accumulator, V·H·4 bytes) or
            ``"lean"`` (two passes over vocabulary slices, no accumulator, the weight gradient
            still rounded once): on one H100 at the demo's model 0.95 GiB less peak for 6-7% more
            step time (docs/benchmarks.md, "The demo on one H100"). Lean is not batch invariant:
            refused with ``batch_invariant=True``; inside ``truefuse.batch_invariant()`` the loss
            runs the default path.
        fuse_residual_norm: each decoder layer's post-attention residual add and
            ``post_attention_layernorm`` run as one ``truefuse.add_rms_norm_hf`` (the stock bits
            forward, one backward kernel), and its ``input_layernorm`` adds the residual stream's
            gradient in its backward kernel (``residual_norm.py``). Off by default until it is timed
            alone against the unfused step on a GPU (its kernels: docs/add_norm.md). Needs ``rms_norm=True``
            and ``stock_norm_bits=True`` (the layer's norm is then ``rms_norm_hf``, whose bits it
            keeps); llama-style layers only (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral).
        fuse_sibling_grads: each attention's q/k/v projections and each MLP's gate/up run as one
            ``truefuse.sibling_linears`` call while training: the stock forward bits and weight
            gradients, the input gradient summed inside the GEMMs instead of by autograd's adds
            (``sibling_grads.py``, docs/sibling_linears.md); in batch-invariant mode the group is
            batch-invariant too. Off by default until it is timed alone against the unfused step on a
            GPU (the op alone: 0.91-0.98x stock's on an H100, docs/benchmarks.md).

    Returns:
        A :class:`PatchReport`. Calling it again on a patched model changes nothing (an experts
        module takes the ``experts_backend`` of the latest call).

    Raises:
        ValueError for an unknown architecture, a tensor-parallel model (a DTensor parameter that
        FSDP2 does not manage: a ``tp_plan``), an unknown ``loss_memory`` (or ``"lean"`` with
        ``batch_invariant=True``), an unknown ``experts_backend``, or an ``experts_backend``
        that cannot run on the experts' weights where they are (``"triton"`` on the CPU without
        the interpreter, or in bf16 there), before anything is patched.
    """
    from truefuse.nn.grouped import check_grouped_path

    experts_backend = check_grouped_path(experts_backend, False, True, arg="experts_backend")
    if fuse_residual_norm and not (rms_norm and stock_norm_bits):
        raise ValueError(
            "apply_truefuse: fuse_residual_norm=True needs rms_norm=True and stock_norm_bits=True (the fused op "
            "keeps rms_norm_hf's bits). Nothing was patched."
        )
    _check_loss_memory(loss_memory, batch_invariant)
    model_type = _model_type(model)
    arch = architecture_of(model_type)
    _refuse_tensor_parallel(model)
    report = PatchReport(model_type)
    norm_cls, mlp_cls = arch.cls(arch.norm), arch.cls(arch.mlp) if arch.mlp else None
    experts_cls = arch.cls(arch.experts) if arch.experts else None
    attn_cls = arch.cls(arch.attention) if arch.attention else None
    plan: list[tuple[torch.nn.Module, type]] = []
    expert_mods: list[torch.nn.Module] = []
    for m in model.modules():
        stock = getattr(type(m), "_truefuse_stock", type(m))
        if isinstance(m, norm_cls):
            if rms_norm:
                plan.append((m, modules.norm_class(stock, arch.norm_style, stock_norm_bits)))
                how = (
                    f"truefuse.rms_norm_hf (style {arch.norm_style}: stock bits)"
                    if stock_norm_bits
                    else "truefuse.rms_norm (one rounding)"
                )
                report.replaced[(stock.__name__, how)] += 1
            else:
                report.left[(stock.__name__, "rms_norm=False")] += 1
        elif mlp_cls is not None and isinstance(m, mlp_cls):
            gated = modules.gated_for(m.act_fn)
            if not mlp:
                report.left[(stock.__name__, "mlp=False")] += 1
            elif gated is None:
                report.left[(stock.__name__, f"activation {type(m.act_fn).__name__} has no truefuse kernel")] += 1
            else:
                plan.append((m, modules.mlp_class(stock)))
                report.replaced[(stock.__name__, f"truefuse.gated_activation ({gated}, one rounding)")] += 1
        elif attn_cls is not None and isinstance(m, attn_cls):
            if rope:
                plan.append((m, modules.attention_class(stock)))
                report.replaced[(stock.__name__, "truefuse.apply_rotary_pos_emb (rope: stock bits)")] += 1
            else:
                report.left[(stock.__name__, "rope=False")] += 1
        elif experts_cls is not None and isinstance(m, experts_cls):
            if experts:
                expert_mods.append(m)
            else:
                report.left[(stock.__name__, "experts=False")] += 1
    if fuse_residual_norm:
        plan += _residual_norm_plan(model, arch, norm_cls, report)
    siblings_patch = _siblings_patcher(model, report) if fuse_sibling_grads else None
    expert_patch = _experts_patcher(expert_mods, report, experts_backend) if expert_mods else None
    loss_patch = _loss_patcher(model, arch, linear_cross_entropy, report, loss_memory)
    bi_patch = _bi.patcher(model, report) if batch_invariant else None
    attention = batch_invariant if attention is None else attention
    attention_patch = _attention_patcher(model, report) if attention else None
    # everything is checked: now patch
    for m, cls in plan:
        m.__class__ = cls
    if expert_patch:
        expert_patch()
    if loss_patch:
        loss_patch()
    if bi_patch:
        bi_patch()
    if attention_patch:
        attention_patch()
    if siblings_patch:
        siblings_patch()
    return report


def _siblings_patcher(model: torch.nn.Module, report: PatchReport):
    from truefuse.integrations.huggingface import sibling_grads

    return sibling_grads.plan(model, report)


def _residual_norm_plan(model: torch.nn.Module, arch: Architecture, norm_cls: type, report: PatchReport) -> list:
    """The decoder layers (modules with a ``post_attention_layernorm``) whose forward fuses its
    post-attention add and norm (``residual_norm.py``); the others counted as left, with why."""
    from truefuse.integrations.huggingface import residual_norm

    plan = []
    for m in model.modules():
        if not hasattr(m, "post_attention_layernorm"):
            continue
        stock = getattr(type(m), "_truefuse_stock", type(m))
        reason = residual_norm.unsupported_reason(m, norm_cls, arch.norm_style)
        if reason:
            report.left[(stock.__name__, f"fuse_residual_norm: {reason}")] += 1
        else:
            plan.append((m, residual_norm.layer_class(stock)))
            report.replaced[(stock.__name__, "truefuse.add_rms_norm_hf (post-attention add + norm: stock bits)")] += 1
    return plan


#: Where ``apply_truefuse(attention=True)`` keeps the model's own ``attn_implementation``.
_STOCK_ATTN = "_truefuse_stock_attn_implementation"


def _attention_patcher(model: torch.nn.Module, report: PatchReport):
    from truefuse.integrations.huggingface import attention

    if not hasattr(model, "set_attn_implementation") or not attention.register():
        raise ValueError("apply_truefuse(attention=True) needs transformers' set_attn_implementation. Nothing was patched.")
    current = model.config._attn_implementation
    report.attention = f"truefuse.attention (attn_implementation {current!r} -> {attention.NAME!r})"
    if getattr(model.config, "sliding_window", None) is not None:
        # transformers' mask carries the window (the answer is right), but a sliding layer's cache
        # keeps only the window's keys: decode's key blocks start elsewhere than prefill's
        report.attention += (
            f"; sliding-window layers (sliding_window={model.config.sliding_window}): KV-cache decode is not "
            "bitwise the prefill past the window (docs/batch_invariance.md, limits)"
        )

    def patch():
        if current != attention.NAME:
            model.__dict__[_STOCK_ATTN] = current
            model.set_attn_implementation(attention.NAME)

    return patch


def _experts_patcher(mods: list[torch.nn.Module], report: PatchReport, backend: str | None):
    from truefuse.integrations.huggingface import moe

    todo = []
    for m in mods:
        reason = moe.unsupported_reason(m)
        name = getattr(type(m), "_truefuse_stock", type(m)).__name__
        if reason:
            report.left[(name, reason)] += 1
        else:
            _check_backend_runs(backend, m.gate_up_proj)
            todo.append(m)
            report.replaced[(name, "truefuse grouped GEMMs (GroupedMLP)")] += 1
    return lambda: [moe.patch_experts(m, backend=backend) for m in todo]


def _check_backend_runs(backend: str | None, weight: torch.Tensor) -> None:
    """A ValueError naming ``experts_backend`` when the backend asked for cannot run on the experts'
    weights as they are (issue 31: ``"triton"`` on a CPU model was reported patched, then failed at
    the first forward naming ``backend=``). A meta weight (a model not materialized yet) is not
    judged: the forward checks again on the real device."""
    from truefuse.nn.grouped import resolve_grouped_path

    if backend is None or weight.device.type == "meta":
        return
    try:
        resolve_grouped_path(backend, weight.device, weight.dtype, True, arg="experts_backend")
    except ValueError as e:
        raise ValueError(f"{e} (or experts_backend=None: the default for the device). Nothing was patched.") from None


def _check_loss_memory(loss_memory: object, batch_invariant: bool) -> None:
    from truefuse.ops.lm_head.linear_cross_entropy import MEMORY_MODES

    if loss_memory not in MEMORY_MODES:
        raise ValueError(f"apply_truefuse: loss_memory must be one of {MEMORY_MODES}, got {loss_memory!r}. Nothing was patched.")
    if loss_memory == "lean" and batch_invariant:
        raise ValueError(
            "apply_truefuse: loss_memory='lean' is not batch invariant (its vocabulary slices depend on the "
            "token count); use loss_memory='default' with batch_invariant=True. Nothing was patched."
        )


def _loss_patcher(model: torch.nn.Module, arch: Architecture, wanted: bool, report: PatchReport, memory: str = "default"):
    from truefuse.integrations.huggingface import loss

    if not wanted:
        report.loss_note = "linear_cross_entropy=False"
        return None
    if not isinstance(model, arch.cls(arch.causal_lm)):
        report.loss_note = f"{type(model).__name__} is not a {arch.causal_lm}: no loss to patch"
        return None
    reason = loss.supports_loss(model)
    if reason:
        report.loss_note = reason
        return None
    report.loss = True
    report.loss_memory = memory

    def patch():
        loss.patch_loss(model)
        loss.set_loss_memory(model, memory)

    return patch


def unpatch_truefuse(model: torch.nn.Module) -> None:
    """Give every patched module of ``model`` (and its forward) the stock code back."""
    from truefuse.integrations.huggingface import loss, sibling_grads

    for m in model.modules():
        modules.unpatch(m)
        sibling_grads.unpatch(m)
    loss.unpatch_loss(model)
    _bi.disable(model)
    if _STOCK_ATTN in model.__dict__:
        model.set_attn_implementation(model.__dict__.pop(_STOCK_ATTN))


def _class_patcher(model_type: str):
    def apply(**kw) -> ClassPatch:
        return apply_truefuse_to(model_type, **kw)

    apply.__name__ = f"apply_truefuse_to_{model_type}"
    apply.__doc__ = (
        f"``apply_truefuse_to({model_type!r}, ...)``: patch the {model_type} classes for the models built "
        "after the call; returns the ClassPatch (report, ``remove()``)."
    )
    return apply


apply_truefuse_to_llama = _class_patcher("llama")
apply_truefuse_to_mistral = _class_patcher("mistral")
apply_truefuse_to_qwen2 = _class_patcher("qwen2")
apply_truefuse_to_qwen3 = _class_patcher("qwen3")
apply_truefuse_to_gemma2 = _class_patcher("gemma2")
apply_truefuse_to_gemma3 = _class_patcher("gemma3_text")
apply_truefuse_to_qwen3_moe = _class_patcher("qwen3_moe")
apply_truefuse_to_mixtral = _class_patcher("mixtral")

__all__ = ["ARCHITECTURES", "ClassPatch", "apply_truefuse", "apply_truefuse_to", "unpatch_truefuse"]
