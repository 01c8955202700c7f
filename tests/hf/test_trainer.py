"""``transformers.Trainer`` on a patched tiny Llama (issue 35 item 5): four optimizer steps of
gradient accumulation 2 follow stock's logged losses within 1e-5 relative, through the fused loss
(every micro-batch, no fallback warning), with the ``num_items_in_batch`` stock gets.

Half the samples have 13 of their 16 labels ignored, so micro-batches count different numbers of
tokens (the Trainer's seeded shuffle gave 24 to 48 a step): the loss the Trainer falls back to for
a forward that does not take ``num_items_in_batch`` (each micro-batch's mean, divided by the
accumulation steps) logged losses 1.2e-3 away from stock's (checked by forcing
``model_accepts_loss_kwargs=False`` on the patched run), the fused loss 1e-7. fp32 on the CPU
(``use_cpu=True``; bf16 is for a device that has it, not this test), the ops on their PyTorch
paths (``torch_paths``: the integration's logic; kernels are tested op by op).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer's dependency (truefuse's hf extra)

from tests.hf.tiny import VOCAB, tiny_model  # noqa: E402
from truefuse.integrations.huggingface import apply_truefuse  # noqa: E402

STEPS, ACCUMULATE, BATCH, SEQ = 4, 2, 2, 16


def _dataset() -> list[dict]:
    """STEPS × ACCUMULATE × BATCH samples of a learnable stream; half with their first 13 labels
    ignored (the others their first), so micro-batches differ in counted tokens."""
    g = torch.Generator().manual_seed(7)
    base = torch.arange(SEQ) * 7 % VOCAB
    rows = []
    for i in range(STEPS * ACCUMULATE * BATCH):
        ids = (base + torch.randint(0, 3, (SEQ,), generator=g)) % VOCAB
        labels = ids.clone()
        labels[: 13 if i % 4 < 2 else 1] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def _train(model, tmp_path) -> tuple[list[float], list, object]:
    """The logged training losses, the ``num_items_in_batch`` each forward got, the Trainer."""
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATE,
        max_steps=STEPS,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    seen: list = []
    model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw.get("num_items_in_batch")), with_kwargs=True)
    trainer = Trainer(model=model, args=args, train_dataset=_dataset())
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return losses, [None if n is None else int(n) for n in seen], trainer


def test_trainer_gradient_accumulation_follows_stock(tmp_path, torch_paths, monkeypatch):
    import truefuse.autograd.linear_cross_entropy as lce

    fused = []
    real = lce.linear_cross_entropy
    monkeypatch.setattr(lce, "linear_cross_entropy", lambda *a, **k: fused.append(k["reduction"]) or real(*a, **k))

    stock = tiny_model("llama")
    patched = copy.deepcopy(stock)
    assert apply_truefuse(patched).loss
    a, n_stock, _ = _train(stock, tmp_path / "stock")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        b, n_patched, trainer = _train(patched, tmp_path / "truefuse")

    assert [str(w.message) for w in caught if "truefuse" in str(w.message)] == []  # no fallback to stock logits
    assert fused == ["sum"] * (STEPS * ACCUMULATE)  # every micro-batch on the fused loss, summed then / num_items
    assert trainer.model_accepts_loss_kwargs  # as for stock: the patched forward takes stock's signature
    # the Trainer counts each step's labels (after the shift) once and hands both micro-batches that count
    assert n_patched == n_stock and len(n_stock) == STEPS * ACCUMULATE and None not in n_stock, (n_stock, n_patched)
    assert n_stock[::2] == n_stock[1::2] and len(set(n_stock)) > 1, n_stock
    assert len(a) == len(b) == STEPS and a[-1] < a[0] - 0.1, (a, b)  # it learned
    rel = max(abs(x - y) / abs(x) for x, y in zip(a, b, strict=True))
    assert rel <= 1e-5, (rel, a, b)
