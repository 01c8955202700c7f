"""TRL's trainers on truefuse's LM head (``truefuse.integrations.trl``; issue 45 item 3).

TRL computes every trainer's log-probs and loss through ``add_fused_lm_head``'s
``model(..., fused_lm_head=True)``. With ``use_truefuse_head()`` on, that call runs
``truefuse.linear_log_probs`` (counted here) and never TRL's ``_ChunkedLogProbFunction``; its
output follows TRL's within fp32 rounding, field by field and in GRPO, SFT and DPO training logs
(loss, grad norm, entropy, accuracy, rewards); in batch-invariant mode GRPO's trainer log-probs are
the sampler's (``generate``'s logits through ``truefuse.token_log_probs``) bit for bit. Tiny Llama on
the CPU, the ops on their PyTorch paths (``torch_paths``: the integration's logic; the kernels are
tested op by op).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

import truefuse  # noqa: E402
import truefuse.integrations.trl as tf_trl  # noqa: E402
from tests.hf.tiny import VOCAB, tiny_model  # noqa: E402
from truefuse.integrations.huggingface import apply_truefuse, graph_decode, model_log_probs  # noqa: E402
from truefuse.integrations.huggingface.log_probs import logits_dtype, positions  # noqa: E402

ALL = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
PAD, EOS, BOS = 0, 1, 2
#: Log keys that are wall-clock times, not results.
TIMES = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}


@pytest.fixture(autouse=True)
def _switch_off_after():
    """Every test leaves TRL's own add_fused_lm_head in place."""
    yield
    if tf_trl._SWITCH is not None:
        tf_trl._SWITCH.undo()


@pytest.fixture
def counts(monkeypatch):
    """``{"truefuse": n, "trl": n}``: calls of truefuse's linear_log_probs by the integration and of
    TRL's chunked head function."""
    import trl.trainer.utils as tu

    n = {"truefuse": 0, "trl": 0}
    real_llp, real_trl = tf_trl.linear_log_probs, tu._ChunkedLogProbFunction

    def llp(*a, **k):
        n["truefuse"] += 1
        return real_llp(*a, **k)

    class Counted:
        @staticmethod
        def apply(*a, **k):
            n["trl"] += 1
            return real_trl.apply(*a, **k)

    monkeypatch.setattr(tf_trl, "linear_log_probs", llp)
    monkeypatch.setattr(tu, "_ChunkedLogProbFunction", Counted)
    return n


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<eos>": EOS, "<bos>": BOS, **{f"w{i}": i for i in range(3, VOCAB)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")


def _model(mode: str, model_type: str = "llama", **kw):
    m = tiny_model(model_type, **kw)
    for cfg in (m.config, m.generation_config):
        cfg.pad_token_id, cfg.eos_token_id, cfg.bos_token_id = PAD, EOS, BOS
    if mode != "stock":
        apply_truefuse(m, batch_invariant=mode == "bi")
    return m


def _batch(seed=0, B=3, L=12):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (B, L), generator=g)
    am = torch.ones_like(ids)
    am[0, :3] = 0  # a left-padded row
    labels = ids.masked_fill(am == 0, -100)
    labels[:, :5] = -100  # a prompt
    labels[2] = -100  # a row with nothing scored
    return ids, am, labels


def _close(a, b, what, rtol=1e-5, atol=1e-6):
    assert (a is None) == (b is None), what
    if a is not None:
        if a.dtype == torch.bool:
            assert torch.equal(a, b), what
        else:
            torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol, msg=what)


# ----------------------------------------------------------------------------------------------
# the fused forward against TRL's, field by field


@pytest.mark.parametrize(("model_type", "shifted"), [("llama", False), ("llama", True), ("gemma2", False), ("qwen3_moe", False)])
def test_fields_match_trl(model_type, shifted, counts, torch_paths):
    """Every FusedCausalLMOutput field and the gradients of loss + entropy follow TRL's head (fp32,
    temperature 0.7; Gemma 2's softcap; Qwen3-MoE's aux loss; pre-shifted labels with
    num_items_in_batch), zeros where the label is -100, an all-ignored row included."""
    import trl.trainer.utils as tu

    ours, theirs = _model("fast", model_type), _model("fast", model_type)
    original = tu.add_fused_lm_head
    switch = tf_trl.use_truefuse_head()
    assert tu.add_fused_lm_head is not original
    original(theirs, temperature=0.7, outputs=ALL)
    tu.add_fused_lm_head(ours, temperature=0.7, outputs=ALL)
    ids, am, labels = _batch()
    # the positions given: truefuse's head numbers them from the mask (generate's), TRL's from the
    # padding, and the two heads are compared here, not the backbones
    kw = dict(input_ids=ids, attention_mask=am, position_ids=positions(am), fused_lm_head=True)
    if shifted:
        shift = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)
        kw.update(shift_labels=shift, num_items_in_batch=7)
    else:
        kw.update(labels=labels)
    if model_type == "qwen3_moe":
        kw.update(output_router_logits=True)
    a, b = ours(**kw), theirs(**kw)
    assert counts == {"truefuse": 1, "trl": 1}
    assert a.label_mask.shape == (3, 12 if shifted else 11)
    for name in ("loss", *ALL, "label_mask", "aux_loss"):
        _close(getattr(a, name), getattr(b, name), name)
    assert not a.log_probs[~a.label_mask].any() and not a.entropy[~a.label_mask].any()
    assert (model_type == "qwen3_moe") == (a.aux_loss is not None)
    for out in (a, b):
        (out.loss + out.entropy.sum()).backward()
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        _close(p.grad, q.grad, name, rtol=1e-4, atol=1e-6)
    assert tf_trl.trl_head(ours).calls == {tf_trl.TRUEFUSE: 1}
    assert tf_trl.trl_head(ours) in switch.heads


def test_outputs_not_asked_are_none_and_generate_runs(torch_paths):
    """Fields not in ``outputs`` are None (no entropy gradient path); without ``fused_lm_head`` the
    model's own forward runs (generate with the class's signature)."""
    import trl.trainer.utils as tu

    tf_trl.use_truefuse_head()
    m = _model("fast")
    tu.add_fused_lm_head(m)
    ids, am, labels = _batch()
    out = m(input_ids=ids, attention_mask=am, labels=labels, fused_lm_head=True)
    assert out.log_probs is not None and out.entropy is None and out.is_top1 is None and out.mean_logits is None
    stock = m(input_ids=ids, attention_mask=am)
    assert stock.logits.shape == (3, 12, VOCAB)
    gen = m.generate(input_ids=ids[1:2], max_new_tokens=3, do_sample=False)
    assert gen.shape == (1, 15)


@pytest.mark.skipif(not hasattr(torch, "get_autocast_dtype"), reason="torch without get_autocast_dtype")
@pytest.mark.parametrize("cast", [False, True])
def test_autocast_and_cast_lm_head_to_fp32(cast, torch_paths):
    """Under bf16 autocast the head's GEMM runs in bf16 like TRL's (cast_lm_head_to_fp32=False) or
    in fp32 outside autocast (True): TRL's values within the GEMM dtype's rounding."""
    import trl.trainer.utils as tu

    ours, theirs = _model("fast"), _model("fast")
    original = tu.add_fused_lm_head
    tf_trl.use_truefuse_head()
    original(theirs, cast_lm_head_to_fp32=cast, outputs=ALL)
    tu.add_fused_lm_head(ours, cast_lm_head_to_fp32=cast, outputs=ALL)
    ids, am, labels = _batch()
    kw = dict(input_ids=ids, attention_mask=am, position_ids=positions(am), labels=labels, fused_lm_head=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = ours(**kw), theirs(**kw)
    tol = dict(rtol=1e-5, atol=1e-5) if cast else dict(rtol=2e-2, atol=2e-2)
    for name in ("loss", "log_probs", "entropy", "log_sum_sq_probs", "mean_logits"):
        _close(getattr(a, name), getattr(b, name), name, **tol)
    assert a.log_probs.dtype == torch.float32


# ----------------------------------------------------------------------------------------------
# fallbacks: TRL's head, recorded and warned


def test_logit_scale_falls_back_to_trl(counts, torch_paths):
    """A logit scale (linear_log_probs has none) runs TRL's head: its exact output, the reason in
    the record and a warning."""
    import trl.trainer.utils as tu

    ours, theirs = _model("fast"), _model("fast")
    for m in (ours, theirs):
        m.config.logit_scale = 0.5
    original = tu.add_fused_lm_head
    tf_trl.use_truefuse_head()
    original(theirs, outputs=ALL)
    tu.add_fused_lm_head(ours, outputs=ALL)
    ids, am, labels = _batch()
    with pytest.warns(UserWarning, match="logit scale 0.5"):
        a = ours(input_ids=ids, attention_mask=am, labels=labels, fused_lm_head=True)
    b = theirs(input_ids=ids, attention_mask=am, labels=labels, fused_lm_head=True)
    assert counts == {"truefuse": 0, "trl": 2}
    assert torch.equal(a.log_probs, b.log_probs) and torch.equal(a.is_top1, b.is_top1)
    rec = tf_trl.trl_head(ours)
    assert rec.fallback.startswith("logit scale 0.5") and rec.head.startswith("trl (logit scale")
    assert rec.calls == {f"trl ({rec.fallback})": 1}


def test_peft(counts, torch_paths):
    """LoRA on the backbone: truefuse's head with the adapters (looked up each call; the loss
    follows TRL's and moves the adapters); an lm_head in modules_to_save: TRL's head, recorded."""
    peft = pytest.importorskip("peft")
    import trl.trainer.utils as tu

    tf_trl.use_truefuse_head()
    ids, am, labels = _batch()
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    outs = []
    for add in (tu.add_fused_lm_head, tf_trl._SWITCH.original):
        base = _model("fast")
        add(base, outputs=ALL)
        pm = peft.get_peft_model(base, copy.deepcopy(lora))
        outs.append(pm(input_ids=ids, attention_mask=am, labels=labels, fused_lm_head=True))
        outs[-1].loss.backward()
        outs[-1] = (outs[-1], next(p.grad for n, p in pm.named_parameters() if "lora_A" in n))
    assert counts == {"truefuse": 1, "trl": 1}
    _close(outs[0][0].loss, outs[1][0].loss, "loss")
    _close(outs[0][1], outs[1][1], "lora_A grad", rtol=1e-4)
    assert outs[0][1].abs().sum() > 0

    base = _model("fast")
    tu.add_fused_lm_head(base)
    pm = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    with pytest.warns(UserWarning, match="not a plain torch.nn.Linear"):
        pm(input_ids=ids, attention_mask=am, labels=labels, fused_lm_head=True)
    rec = tf_trl.trl_head(pm)
    assert rec is tf_trl.trl_head(base) and list(rec.calls) == [
        "trl (lm_head is ModulesToSaveWrapper, not a plain torch.nn.Linear)"
    ]


# ----------------------------------------------------------------------------------------------
# the switch


def test_switch_undo_idempotent_and_refusal(monkeypatch):
    import trl.trainer.grpo_trainer as grpo
    import trl.trainer.sft_trainer as sft
    import trl.trainer.utils as tu

    original = tu.add_fused_lm_head
    with tf_trl.use_truefuse_head() as switch:
        assert tf_trl.use_truefuse_head() is switch
        assert grpo.add_fused_lm_head is sft.add_fused_lm_head is tu.add_fused_lm_head is not original
        assert {"trl.trainer.grpo_trainer", "trl.trainer.sft_trainer", "trl.trainer.dpo_trainer"} <= set(switch.modules)
        assert "on" in str(switch)
    assert grpo.add_fused_lm_head is sft.add_fused_lm_head is tu.add_fused_lm_head is original
    assert tf_trl.use_truefuse_head() is not switch
    tf_trl._SWITCH.undo()
    monkeypatch.delattr(tu, "add_fused_lm_head")
    with pytest.raises(RuntimeError, match="has no trl.trainer.utils.add_fused_lm_head"):
        tf_trl.use_truefuse_head()


# ----------------------------------------------------------------------------------------------
# batch-invariant mode


def test_batch_invariant_bits(torch_paths):
    """In batch-invariant mode the fused call gives ``model_log_probs``' bits, a sequence the same
    bits alone and inside a right-padded batch, and those of ``token_log_probs`` over the model's own
    logits (what ``generate`` samples from) at the same temperature."""
    import trl.trainer.utils as tu

    tf_trl.use_truefuse_head()
    m = _model("bi")
    tu.add_fused_lm_head(m, temperature=0.7, outputs=("log_probs", "entropy"))
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (3, 10), generator=g)
    am = torch.ones_like(ids)
    am[1, 6:] = 0
    labels = ids.masked_fill(am == 0, -100)
    batch = m(input_ids=ids, attention_mask=am, labels=labels, fused_lm_head=True)
    mlp = model_log_probs(m, ids, am, temperature=0.7)
    assert torch.equal(batch.log_probs, mlp.log_probs) and torch.equal(batch.entropy, mlp.entropy)
    for r in range(3):
        n = int(am[r].sum())
        one = m(input_ids=ids[r : r + 1, :n], labels=ids[r : r + 1, :n], fused_lm_head=True)
        assert torch.equal(one.log_probs[0], batch.log_probs[r, : n - 1]), r
        assert torch.equal(one.entropy[0], batch.entropy[r, : n - 1]), r
        m.eval()
        with torch.no_grad():
            logits = m(input_ids=ids[r : r + 1, :n]).logits[:, :-1]
        m.train()
        ref = truefuse.token_log_probs(logits, ids[r : r + 1, 1:n], temperature=0.7)
        assert torch.equal(one.log_probs, ref.log_probs) and torch.equal(one.entropy, ref.entropy), r


# ----------------------------------------------------------------------------------------------
# the trainers


def _args(kind: str, tmp_path, **over):
    import trl

    common = dict(
        output_dir=str(tmp_path),
        max_steps=2,
        report_to="none",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        logging_steps=1,
        save_strategy="no",
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        seed=11,
    )
    common.update(over)
    if kind == "grpo":
        return trl.GRPOConfig(num_generations=2, max_completion_length=6, **common)
    if kind == "sft":
        return trl.SFTConfig(max_length=16, **common)
    return trl.DPOConfig(max_length=16, **common)


def _trainer(kind: str, model, args, cls=None):
    import trl

    tok = _tokenizer()
    if kind == "grpo":
        # prompts of two lengths: TRL left-pads the shorter one
        ds = datasets.Dataset.from_dict({"prompt": ["w5 w6 w7 w8", "w9 w10"] * 2})

        def reward(completions, **kw):
            return [float(len(c)) for c in completions]

        cls = cls or trl.GRPOTrainer
        return cls(model=model, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tok)
    if kind == "sft":
        ds = datasets.Dataset.from_dict({"text": ["w5 w6 w7 w8 w9", "w9 w10 w11 w12 w3 w4"] * 4})
        return trl.SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok)
    ds = datasets.Dataset.from_dict(
        {"prompt": ["w5 w6", "w9 w10"] * 4, "chosen": [" w7 w8", " w11"] * 4, "rejected": [" w3", " w4 w4"] * 4}
    )
    ref = copy.deepcopy(model)
    return trl.DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=ds, processing_class=tok)


@pytest.mark.parametrize("mode", ["fast", "bi"])
@pytest.mark.parametrize("kind", ["grpo", "sft", "dpo"])
def test_trainer_runs_truefuse_head(kind, mode, counts, tmp_path, torch_paths):
    """Two steps with the switch on run truefuse's head only (every fused call, model and DPO's
    reference model); the logged losses, grad norms and metrics follow the same trainer on TRL's
    head (the switch off) within fp32 rounding."""
    logs = {}
    for on in (True, False):
        switch = tf_trl.use_truefuse_head() if on else None
        trainer = _trainer(kind, _model(mode), _args(kind, tmp_path))
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # a fallback warns
            warnings.filterwarnings("ignore", message=r"(?!truefuse)")
            trainer.train()
        logs[on] = trainer.state.log_history
        if on:
            ran = counts["truefuse"]
            assert ran >= 2 and counts["trl"] == 0
            heads = [tf_trl.trl_head(trainer.model)] + ([tf_trl.trl_head(trainer.ref_model)] if kind == "dpo" else [])
            assert sum(h.calls[tf_trl.TRUEFUSE] for h in heads) == ran
            assert all(set(h.calls) == {tf_trl.TRUEFUSE} for h in heads)
            switch.undo()
        else:
            assert counts["truefuse"] == ran and counts["trl"] > 0
            assert tf_trl.trl_head(trainer.model) is None
    assert len(logs[True]) == len(logs[False]) == 3
    for ours, theirs in zip(logs[True], logs[False], strict=True):
        assert ours.keys() == theirs.keys()
        for k in ours.keys() - TIMES:
            assert ours[k] == pytest.approx(theirs[k], rel=1e-4, abs=1e-6), (k, ours, theirs)
    assert "loss" in logs[True][0] and "grad_norm" in logs[True][0]


@pytest.mark.parametrize("kind", ["grpo", "sft"])
def test_trainers_with_trl_defaults_stock_fast_bi(kind, counts, tmp_path, torch_paths):
    """GRPO and SFT with TRL's defaults (bf16 autocast over the fp32 model, gradient checkpointing):
    stock, fast mode and batch-invariant mode (each with the switch on but stock) train, truefuse's
    head runs for the patched ones, and their logged losses and gradient norms follow stock's
    within bf16's reach (BI raised under autocast and lost its mode under checkpointing before)."""
    logs = {}
    for mode in ("stock", "fast", "bi"):
        before = counts["truefuse"]
        switch = tf_trl.use_truefuse_head() if mode != "stock" else None
        trainer = _trainer(kind, _model(mode), _args(kind, tmp_path, bf16=True, gradient_checkpointing=True))
        trainer.train()
        assert trainer.model.is_gradient_checkpointing
        logs[mode] = trainer.state.log_history
        if switch is not None:
            assert counts["truefuse"] > before
            switch.undo()
    for mode in ("fast", "bi"):
        for ours, theirs in zip(logs[mode], logs["stock"], strict=True):
            for k in ("loss", "grad_norm"):
                if k in theirs:
                    assert ours[k] == pytest.approx(theirs[k], rel=5e-2, abs=2e-3), (mode, k, ours, theirs)
    assert "grad_norm" in logs["bi"][0]


# ----------------------------------------------------------------------------------------------
# GRPO: the sampler's log-probs are the trainer's, bit for bit


def _sampler_equals_trainer(tmp_path, graphed: bool = False, dtype=torch.float32, **over):
    import trl

    samples: dict[tuple, torch.Tensor] = {}
    autocast = set()  # (sampling, whether the backbone ran under autocast)
    sampling_now = [False]
    trained: list[tuple] = []

    class Recording(trl.GRPOTrainer):
        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *a, **k):
            out = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, *a, **k)
            trained.append((input_ids, attention_mask[:, -logits_to_keep:].bool(), logits_to_keep, out[0].detach()))
            return out

    tf_trl.use_truefuse_head()
    model = _model("bi").to(dtype)
    graphs = graph_decode(model) if graphed else None
    args = _args("grpo", tmp_path, **over)
    generate = model.generate

    def sampling(*a, **k):
        # what TRL gets back is unchanged (the sequences); the raw logits of each step are kept
        sampling_now[0] = True
        try:
            out = generate(*a, **k, output_logits=True, return_dict_in_generate=True)
        finally:
            sampling_now[0] = False
        P = k["input_ids"].shape[1]
        comp = out.sequences[:, P:]
        after_eos = (comp == EOS).int().cumsum(1) - (comp == EOS).int() > 0
        target = comp.masked_fill(after_eos, -100)
        # generate's logits upcast to fp32, back in the dtype the head reads (generate_log_probs')
        steps = torch.stack(out.logits, 1).to(logits_dtype(model))
        lp = truefuse.token_log_probs(steps, target, temperature=args.temperature).log_probs
        for r in range(comp.shape[0]):
            keep = ~after_eos[r]
            samples[(tuple(k["input_ids"][r].tolist()), tuple(comp[r][keep].tolist()))] = lp[r][keep]
        return out.sequences

    model.generate = sampling
    # accelerate runs the model's forward (generate's too) under its autocast: record where it was on
    model.model.register_forward_pre_hook(lambda *_: autocast.add((sampling_now[0], torch.is_autocast_enabled("cpu"))))
    trainer = _trainer("grpo", model, args, cls=Recording)
    trainer.train()
    assert samples and trained
    assert set(tf_trl.trl_head(trainer.model).calls) == {tf_trl.TRUEFUSE}
    compared = 0
    for ids, mask, n, lp in trained:
        for r in range(ids.shape[0]):
            prompt, comp = ids[r, :-n], ids[r, -n:][mask[r]]
            sampled = samples[(tuple(prompt.tolist()), tuple(comp.tolist()))]
            assert torch.equal(lp[r][mask[r]], sampled), (lp[r][mask[r]], sampled)
            compared += int(mask[r].sum())
    assert compared >= 2 * 6
    if graphs is not None:  # the sampler's decode steps were replays, not the eager forward
        assert graphs.captures >= 1 and graphs.replays >= 2, (graphs.captures, graphs.replays)
    return trainer, autocast


def test_grpo_sampler_equals_trainer_bitwise(tmp_path, torch_paths):
    """Batch-invariant mode, HF generate as the sampler, fp32 without gradient checkpointing: each
    completion token's log-prob from generate's logits (``token_log_probs``) is the one GRPO's
    trainer computes on truefuse's head, bit for bit, left-padded prompts included (the head numbers
    positions from the attention mask, as generate does; TRL's own forward numbers them from the
    padding)."""
    trainer, autocast = _sampler_equals_trainer(tmp_path)
    assert not trainer.model.is_gradient_checkpointing and autocast == {(True, False), (False, False)}


def test_grpo_sampler_equals_trainer_bitwise_defaults(tmp_path, torch_paths):
    """The same under TRL's defaults: bf16 (accelerate runs the model's forward, generate's included,
    under bf16 autocast) and gradient checkpointing (the recompute runs batch-invariant)."""
    trainer, autocast = _sampler_equals_trainer(tmp_path, bf16=True, gradient_checkpointing=True)
    assert trainer.model.is_gradient_checkpointing and autocast == {(True, True), (False, True)}


def _static_cache_takes_values_own_dtype() -> bool:
    """Whether transformers' static cache sizes its values from the value states (5.25), not from the
    keys' dtype alone (5.17): an fp32 model under bf16 autocast has fp32 keys after the rotary
    embedding (bf16 times fp32 cos) and bf16 values, which 5.17's cache cannot take, stock or not.
    Asked of the layer itself: 5.17's ``lazy_initialization`` takes the value states too, and
    still gives the values the keys' dtype."""
    from transformers.cache_utils import StaticLayer

    try:
        layer = StaticLayer(max_cache_len=2)
        layer.lazy_initialization(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2, dtype=torch.bfloat16))
    except Exception:  # another constructor or initialisation: the fp32 case is not run there
        return False
    return layer.values.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grpo_graphed_sampler_equals_trainer_bitwise(tmp_path, torch_paths, fake_cuda, dtype):
    """The same with the sampler's decode steps replayed as graphs (``graph_decode`` and
    ``GRPOConfig(cache_implementation="static")``, docs/trl.md), under TRL's defaults: the graphs
    (a CPU stand-in here; tests/hf/test_graphed_decode.py runs the real ones on CUDA) sit behind
    accelerate's autocast wrapper of the forward, and the log-probs stay the trainer's bits; an
    fp32 model and one loaded in bf16."""
    if dtype == torch.float32 and not _static_cache_takes_values_own_dtype():
        pytest.skip(
            "this transformers' static cache takes the keys' dtype for its values: fp32 keys and bf16 values fail in stock too"
        )
    trainer, autocast = _sampler_equals_trainer(
        tmp_path, graphed=True, dtype=dtype, bf16=True, gradient_checkpointing=True, cache_implementation="static"
    )
    assert trainer.model.is_gradient_checkpointing and autocast == {(True, True), (False, True)}
