"""The measurements of ``python -m truefuse parity`` (docs/batch_invariance.md): does a model give a
sequence the same answer wherever it runs?

* :func:`alone_vs_batch`: each sequence alone vs inside a right- or left-padded batch (positions
  counted over attended tokens, as ``generate`` counts them);
* :func:`generate_vs_forward`: the logits of each step of greedy ``generate`` (KV cache,
  left-padded prompts) vs one full forward over prompt + generated tokens;
* :func:`sampler_vs_trainer`: docs/batch_invariance.md's RL recipe: the sampled tokens' log-probs
  from ``generate``'s logits (``token_log_probs``, the sampler) vs ``model_log_probs`` over prompt
  + completion (the trainer);
* :func:`training_runs`: a few AdamW steps, run twice from the same state and batches;
* :func:`first_divergence`: the first module (forward hooks on every module) whose output for a
  sequence differs between alone and in a batch.

Log-probs are ``truefuse.token_log_probs`` of the next token from each row's logits. "Ratio out"
is the share of tokens whose probability ratio exp(Δ log-prob) leaves [0.9, 1.1], the figure RL
papers report for sampler/trainer mismatch.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from truefuse.autograd.token_log_probs import token_log_probs
from truefuse.integrations.huggingface.log_probs import positions


@dataclass
class Diff:
    """Rows (tokens) compared, how many differ in any logit, max |Δ log-prob| and the share of
    tokens whose probability ratio leaves [0.9, 1.1]."""

    rows: int = 0
    differing: int = 0
    max_dlp: float = 0.0
    ratio_out: float = 0.0

    def add(self, a: torch.Tensor, b: torch.Tensor, target: torch.Tensor) -> None:
        """Compare logits ``a`` and ``b`` (n, V) whose next tokens are ``target`` (n,)."""
        same = (a == b) | (a.isnan() & b.isnan())
        d = token_log_probs(a.float(), target).log_probs - token_log_probs(b.float(), target).log_probs
        self._count(int((~same.all(-1)).sum()), d)

    def add_log_probs(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """Compare log-probs ``a`` and ``b`` (n,) of the same tokens."""
        self._count(int((a != b).sum()), a - b)

    def _count(self, differing: int, d: torch.Tensor) -> None:
        n = d.shape[0]
        self.differing += differing
        d = d.double()
        out = (d.exp() < 0.9) | (d.exp() > 1.1)
        self.ratio_out = (self.ratio_out * self.rows + float(out.sum())) / max(self.rows + n, 1)
        self.rows += n
        self.max_dlp = max(self.max_dlp, float(d.abs().max()) if n else 0.0)


def pad(seqs: list[torch.Tensor], side: str, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention_mask) of ``seqs`` padded on ``side`` ("right" or "left") to the longest."""
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long, device=seqs[0].device)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        cols = slice(0, len(s)) if side == "right" else slice(L - len(s), L)
        ids[i, cols], mask[i, cols] = s, 1
    return ids, mask


def _rows(i: int, n: int, L: int, side: str) -> slice:
    return slice(0, n) if side == "right" else slice(L - n, L)


def _forward(model, ids, mask=None):
    kw = {} if mask is None else {"attention_mask": mask, "position_ids": positions(mask)}
    return model(input_ids=ids, use_cache=False, **kw).logits


@torch.no_grad()
def alone_vs_batch(model, seqs: list[torch.Tensor], side: str) -> Diff:
    """Each sequence's logits alone vs its rows inside the ``side``-padded batch of all of them."""
    diff = Diff()
    ids, mask = pad(seqs, side)
    batch = _forward(model, ids, mask)
    for i, s in enumerate(seqs):
        alone = _forward(model, s[None])[0]
        rows = batch[i, _rows(i, len(s), ids.shape[1], side)]
        diff.add(alone[:-1], rows[:-1], s[1:])
    return diff


@torch.no_grad()
def generate_vs_forward(model, prompts: list[torch.Tensor], new_tokens: int) -> Diff:
    """Greedy ``generate`` (KV cache, left-padded prompts): each step's logits vs one full forward."""
    ids, mask = pad(prompts, "left")
    model.generation_config.eos_token_id = None  # every step of every prompt, no early stop
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    steps = torch.stack(out.logits, 1)  # (B, n, V)
    full_mask = torch.cat([mask, torch.ones_like(out.sequences[:, ids.shape[1] :])], 1)
    P = ids.shape[1]
    full = _forward(model, out.sequences, full_mask)[:, P - 1 : P - 1 + new_tokens]
    gen = out.sequences[:, P:]
    diff = Diff()
    for b in range(len(prompts)):
        diff.add(steps[b], full[b].to(steps.dtype), gen[b])
    return diff


@torch.no_grad()
def sampler_vs_trainer(model, prompts: list[torch.Tensor], new_tokens: int, temperature: float = 1.0, seed: int = 0) -> Diff:
    """Sampled ``generate`` (KV cache, left-padded prompts, ``temperature``, no top-k/top-p): each
    sampled token's log-prob from the step's logits (``token_log_probs``) vs ``model_log_probs``
    over prompt + completion, the two numbers an RL importance ratio divides."""
    from truefuse.integrations.huggingface.log_probs import generate_log_probs, model_log_probs

    ids, mask = pad(prompts, "left")
    model.generation_config.eos_token_id = None
    torch.manual_seed(seed)
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=True,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    P = ids.shape[1]
    gen = out.sequences[:, P:]
    sampler = generate_log_probs(model, out, P, temperature=temperature).log_probs
    full_mask = torch.cat([mask, torch.ones_like(gen)], 1)
    trainer = model_log_probs(model, out.sequences, full_mask, temperature=temperature).log_probs[:, P - 1 :]
    diff = Diff()
    diff.add_log_probs(sampler.reshape(-1), trainer.reshape(-1))
    return diff


def training_runs(model, batches: list[torch.Tensor], lr: float = 1e-3) -> list[float]:
    """The losses of AdamW steps over ``batches`` (labels = ids) on a copy of ``model``."""
    model = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _first_tensor(out):
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return getattr(out, "last_hidden_state", None)


def first_divergence(model, seqs: list[torch.Tensor], side: str) -> str | None:
    """The first module (in call order) whose output differs between alone and inside the
    ``side``-padded batch, for the first sequence where one does; None when none does."""
    for i in range(len(seqs)):
        name = _first_divergence(model, seqs, side, i)
        if name is not None:
            return f"{name} (sequence {i})"
    return None


@torch.no_grad()
def _first_divergence(model, seqs: list[torch.Tensor], side: str, i: int) -> str | None:
    records: dict[str, list] = {"alone": [], "batch": []}
    where = ["alone"]
    hooks = []
    for name, mod in model.named_modules():

        def hook(m, args, out, name=name):
            t = _first_tensor(out)
            if t is not None and t.dim() >= 2:
                records[where[0]].append((name, t.detach().clone()))

        hooks.append(mod.register_forward_hook(hook))
    try:
        _forward(model, seqs[i][None])
        where[0] = "batch"
        ids, mask = pad(seqs, side)
        _forward(model, ids, mask)
    finally:
        for h in hooks:
            h.remove()
    batch = dict(records["batch"])
    n, L = len(seqs[i]), ids.shape[1]
    for name, a in records["alone"]:
        b = batch.get(name)
        if b is None or b.dim() != a.dim() or b.shape[0] != len(seqs) or a.shape[1] != n or b.shape[1] != L:
            continue  # not a (batch, tokens, ...) output
        if not torch.equal(a[0], b[i, _rows(i, n, L, side)]):
            return name or type(model).__name__
    return None
