"""Batch-invariant mode where RL users run it (issue 45): the sampler recipe of
docs/batch_invariance.md (``generate_log_probs`` of ``generate``'s logits) equals the
trainer's ``model_log_probs`` bit for bit, in fp32 and under bf16 ``torch.autocast`` (TRL's
``bf16=True``); gradient checkpointing (reentrant or not) recomputes the layers in the mode, so the
gradients are those without it; a PEFT LoRA model runs its adapters on the batch-invariant GEMM."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from conftest import requires_cuda  # noqa: E402

import truefuse  # noqa: E402
from tests.hf.tiny import VOCAB, tiny_model  # noqa: E402
from truefuse.integrations.huggingface import apply_truefuse, generate_log_probs, model_log_probs  # noqa: E402
from truefuse.integrations.huggingface import batch_invariant as bi  # noqa: E402

PROMPTS, NEW, T = 24, 6, 0.9


def _prompts(seed=0):
    """``PROMPTS`` random prompts of 2-9 tokens, left-padded (0), and their mask."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 10, (PROMPTS,), generator=g)
    ids = torch.zeros(PROMPTS, int(lengths.max()), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths.tolist()):
        ids[i, -n:] = torch.randint(1, VOCAB, (n,), generator=g)
        mask[i, -n:] = 1
    return ids, mask


def _autocast(on: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16) if on else contextlib.nullcontext()


def _sampler_and_trainer(model, amp: bool, seed=1):
    """The documented recipe: the sampled tokens' log-probs from ``generate``'s logits
    (``generate_log_probs``), and the trainer's from ``model_log_probs`` over prompt + completion."""
    ids, mask = _prompts()
    ids, mask = ids.to(model.device), mask.to(model.device)
    torch.manual_seed(seed)
    with torch.no_grad(), _autocast(amp):
        out = model.generate(
            ids,
            attention_mask=mask,
            do_sample=True,
            temperature=T,
            top_k=0,
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        completion = out.sequences[:, ids.shape[1] :]
        sampler = generate_log_probs(model, out, ids.shape[1], temperature=T).log_probs
        full = torch.cat([mask, torch.ones_like(completion)], 1)
        trainer = model_log_probs(model, out.sequences, full, temperature=T).log_probs[:, -NEW:]
    return sampler, trainer


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "autocast-bf16"])
@pytest.mark.parametrize("model_type", ["llama", "qwen3", "qwen3_moe"])
def test_sampler_recipe_equals_trainer(model_type, amp, torch_paths):
    model = tiny_model(model_type, num_hidden_layers=1, hidden_size=64, intermediate_size=128).eval()
    apply_truefuse(model, batch_invariant=True)
    sampler, trainer = _sampler_and_trainer(model, amp)
    assert sampler.shape == (PROMPTS, NEW)
    assert torch.equal(sampler, trainer), f"{int((sampler != trainer).sum())} of {sampler.numel()} differ"


def test_model_log_probs_runs_in_the_models_mode(torch_paths, monkeypatch):
    """``model_log_probs`` calls ``model.base_model`` past the forward's hooks: it must still route
    every ``F.linear`` to the batch-invariant GEMM (none left to torch's)."""
    model = tiny_model("llama", num_hidden_layers=1).eval()
    apply_truefuse(model, batch_invariant=True)
    stock = _count_stock_linear(monkeypatch)
    ids = torch.randint(1, VOCAB, (2, 7))
    with torch.no_grad():
        model_log_probs(model, ids)
    assert stock[0] == 0


def _count_stock_linear(monkeypatch):
    """Counts the ``F.linear`` calls torch's own function computes (outside the routing)."""
    n = [0]
    real = bi._STOCK_LINEAR

    def counted(*a, **k):
        n[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(bi, "_STOCK_LINEAR", counted)
    monkeypatch.setattr(F, "linear", counted)
    return n


def _grads(model, ids, checkpointing, reentrant=False):
    model = copy.deepcopy(model).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    loss = model(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointing_recomputes_in_the_mode(reentrant, torch_paths, monkeypatch):
    """TRL's default ``gradient_checkpointing=True``: the recomputed layers run batch-invariant
    (non-reentrant raised CheckpointError: other saved tensors), the gradients those without it."""
    model = tiny_model("llama", num_hidden_layers=2)
    apply_truefuse(model, batch_invariant=True)
    ids = torch.randint(1, VOCAB, (3, 9), generator=torch.Generator().manual_seed(0))
    loss, grads = _grads(model, ids, False)
    stock = _count_stock_linear(monkeypatch)
    loss_ck, grads_ck = _grads(model, ids, True, reentrant)
    assert stock[0] == 0, "a recomputed layer ran torch's F.linear"
    assert torch.equal(loss, loss_ck)
    for name, g in grads.items():
        assert torch.equal(g, grads_ck[name]), name


def test_autocast_runs_as_stock_does(torch_paths):
    """Under bf16 autocast over an fp32 model (TRL's ``bf16=True``) the BI model runs (it raised in
    ``truefuse.attention``: q/k fp32 out of the rope, v bf16 out of its GEMM), its logits in bf16 as
    stock's, within bf16's reach of stock's."""
    model = tiny_model("llama", num_hidden_layers=1).eval()
    patched = copy.deepcopy(model)
    apply_truefuse(patched, batch_invariant=True)
    ids = torch.randint(1, VOCAB, (2, 8))
    with torch.no_grad(), _autocast(True):
        want, got = model(ids).logits, patched(ids).logits
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=0.05, rtol=0.05)


def test_attention_casts_as_sdpa_under_autocast():
    q = torch.randn(1, 2, 5, 8)
    v = q.bfloat16()
    with _autocast(True):
        got = truefuse.attention(q, q, v, is_causal=True)
        want = F.scaled_dot_product_attention(q, q, v, is_causal=True)
        dbl = truefuse.attention(q.double(), q.double(), q.double())
    assert got.dtype == want.dtype == torch.bfloat16 and dbl.dtype == torch.float64
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_peft_lora_on_the_batch_invariant_gemm(torch_paths, monkeypatch):
    """A PEFT LoRA model over a BI model: ``model_log_probs`` takes it (it read a
    ``last_hidden_state`` the wrapper does not return), every ``F.linear`` (adapters too) is routed,
    and its answer is the sampler's ``token_log_probs`` of the wrapper's own logits."""
    peft = pytest.importorskip("peft")
    model = tiny_model("llama", num_hidden_layers=1)
    apply_truefuse(model, batch_invariant=True)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    with torch.no_grad():  # non-zero adapters: lora_B starts at 0
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    lora.eval()
    ids, mask = _prompts()
    stock = _count_stock_linear(monkeypatch)
    with torch.no_grad():
        got = model_log_probs(lora, ids, mask).log_probs
        assert stock[0] == 0
        for i in range(3):  # each sequence alone, by the wrapper's forward
            n = int(mask[i].sum())
            s = ids[i, -n:][None]
            alone = truefuse.token_log_probs(lora(s).logits[:, :-1], s[:, 1:]).log_probs[0]
            assert torch.equal(got[i, ids.shape[1] - n :], alone)


def test_parity_checks_the_recipe(torch_paths, monkeypatch):
    """``python -m truefuse parity``'s "sampler vs trainer" row: 0 on a BI model under autocast, and
    it counts a trainer log-prob that moved (so the row, and parity's exit status, can fail)."""
    from truefuse.demo import parity
    from truefuse.integrations.huggingface import log_probs

    model = tiny_model("llama", num_hidden_layers=1).eval()
    apply_truefuse(model, batch_invariant=True)
    prompts = [torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 6, 4)]
    with _autocast(True):
        assert parity.sampler_vs_trainer(model, prompts, 4).differing == 0
        real = log_probs.model_log_probs

        def moved(*a, **k):
            out = real(*a, **k)
            out.log_probs[1, -2] += 1e-3
            return out

        monkeypatch.setattr(log_probs, "model_log_probs", moved)
        d = parity.sampler_vs_trainer(model, prompts, 4)
    assert (d.rows, d.differing) == (12, 1) and d.max_dlp > 0


@requires_cuda
@pytest.mark.parametrize("amp", [False, True], ids=["bf16", "autocast-bf16"])
def test_sampler_recipe_equals_trainer_cuda(amp):
    """The recipe on the GPU's kernels at a real vocabulary: ``generate`` upcasts its logits to fp32,
    the head reads its own in bf16, and the log-prob kernel's bits follow the dtype it loads (1 of 96
    tokens 1 ulp off on an H100 before ``generate_log_probs`` cast them back)."""
    from truefuse.demo.parity_cli import build

    dtype = torch.float32 if amp else torch.bfloat16
    model = build("llama", 2, 256, 32000, dtype, torch.device("cuda"), 0)
    apply_truefuse(model, batch_invariant=True)
    sampler, trainer = _sampler_and_trainer(model, amp)
    assert torch.equal(sampler, trainer), f"{int((sampler != trainer).sum())} of {sampler.numel()} differ"


def test_generate_log_probs_casts_back_to_the_models_logits_dtype(monkeypatch):
    """``generate``'s fp32 logits go to ``token_log_probs`` in the dtype the model's forward gives
    (bf16 for a bf16 model or under bf16 autocast, fp32 otherwise)."""
    import truefuse.autograd.token_log_probs as tlp
    from truefuse.integrations.huggingface.log_probs import logits_dtype

    seen = []
    real = tlp.token_log_probs
    monkeypatch.setattr(tlp, "token_log_probs", lambda z, *a, **k: seen.append(z.dtype) or real(z, *a, **k))
    fp32, bf16 = tiny_model("llama", num_hidden_layers=1), tiny_model("llama", torch.bfloat16, num_hidden_layers=1)

    class Out:
        logits = [torch.randn(2, VOCAB).bfloat16().float() for _ in range(3)]
        sequences = torch.randint(1, VOCAB, (2, 7))

    for model, amp in ((fp32, False), (fp32, True), (bf16, False)):
        with _autocast(amp):
            assert generate_log_probs(model, Out, 4).log_probs.shape == (2, 3)
            assert seen[-1] == logits_dtype(model)
    assert seen == [torch.float32, torch.bfloat16, torch.bfloat16]


def test_unpatch_gives_the_layers_back():
    """``unpatch_truefuse`` of a BI model: the decoder layers get their stock class and carry no
    mode, and the model runs stock (F.linear torch's own)."""
    from truefuse.integrations.huggingface import unpatch_truefuse

    stock = tiny_model("llama", num_hidden_layers=2)
    model = copy.deepcopy(stock)
    apply_truefuse(model, batch_invariant=True)
    layer_cls = type(stock.model.layers[0])
    assert type(model.model.layers[0]) is not layer_cls and model.model.layers[0].__dict__.get("_truefuse_bi_mode")
    unpatch_truefuse(model)
    assert all(type(m) is layer_cls and "_truefuse_bi_mode" not in m.__dict__ for m in model.model.layers)
    assert not bi.is_enabled(model)
