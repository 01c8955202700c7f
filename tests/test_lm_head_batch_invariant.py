"""The chunked LM head in batch-invariant mode (docs/design.md §1): a token's loss, log-prob,
entropy and input gradient are the same bits whether it comes alone, in a slice or in the whole
call, with several chunks and a vocabulary the default mode would split. The head's GEMMs take the
planner's batch-invariant plan under the switch (docs/design.md §3)."""

from __future__ import annotations

import pytest
import torch

import truefuse
import truefuse.ops.lm_head.chunked_head as chunked_head
from truefuse.config import tuning
from truefuse.ops.lm_head.chunked_head import default_chunk, invariant_chunk
from truefuse.ops.lm_head.chunked_head_gemms import vocab_split
from truefuse.verify.cases_linear_cross_entropy import make_inputs

SLICES = [slice(0, 1), slice(4, 12)]
UP = torch.randn(12, 2, generator=torch.Generator().manual_seed(1))  # token i's upstream, wherever it is


def _per_token(op, x, W, t, b, up):
    """The per-token outputs of ``op`` and d_input under the per-token upstream ``up`` (N, 2)."""
    x = x.detach().clone().requires_grad_()
    if op == "linear_cross_entropy":
        outs = (truefuse.linear_cross_entropy(x, W, t, linear_bias=b, reduction="none"),)
    else:
        outs = tuple(truefuse.linear_log_probs(x, W, t, linear_bias=b, temperature=0.7))
    sum(o @ up[:, i].to(o.dtype) for i, o in enumerate(outs)).backward()
    return [o.detach() for o in outs] + [x.grad]


@pytest.mark.parametrize(
    "op, dtype",
    [("linear_log_probs", torch.float32), ("linear_log_probs", torch.bfloat16), ("linear_cross_entropy", torch.bfloat16)],
    ids=["log_probs_fp32_kernel", "log_probs_bf16_torch", "cross_entropy_bf16_torch"],
)
def test_rows_of_a_slice_equal_the_whole_call(op, dtype):
    """fp32 on the CPU runs the Triton loss kernels (interpreter; the cross-entropy's is the same
    one program per row, left out for time), bf16 their PyTorch math."""
    x, W, t, b = make_inputs(dtype, torch.device("cpu"), N=12, H=8, V=70, bias=True)
    # chunks of 8 tokens (no weight gradient: no accumulator); the default mode would split the
    # vocabulary of 8-token chunks (8 x 70 x 8 >= 3000 multiply-adds) and not of one token's
    with tuning(chunk_bytes=8 * 70 * x.element_size(), min_macs=3000), truefuse.batch_invariant():
        assert invariant_chunk(70, 8, x.element_size(), False) == 8
        whole = _per_token(op, x, W, t, b, UP)
        for s in SLICES:
            part = _per_token(op, x[s], W, t[s], b, UP[s])
            names = ("out0", "out1", "d_input")[-len(whole) :]
            for name, w, p in zip(names, whole, part, strict=True):
                assert torch.equal(w[s], p), f"{op} {name} rows {s}"


def test_backward_after_the_block_takes_the_forwards_path(monkeypatch):
    """The mode is read in the forward: a backward outside the ``with`` keeps the unsplit GEMMs."""
    calls = []
    monkeypatch.setattr(chunked_head, "vocab_split", lambda x, V, bi=False: calls.append(bi) or vocab_split(x, V, bi))
    x, W, t, _ = make_inputs(torch.bfloat16, torch.device("cpu"), N=8, H=16, V=70)
    x.requires_grad_()
    with tuning(min_macs=1):
        with truefuse.batch_invariant():
            lp = truefuse.linear_log_probs(x, W, t, chunk_size=4).log_probs
        lp.sum().backward()
    assert len(calls) == 4 and all(calls), calls  # 2 chunks, forward and backward


def test_chunk_and_split_do_not_read_the_token_count(device):
    x = torch.zeros(4096, 64, device=device)  # where the loss kernel runs: the split needs it
    with tuning(min_macs=1):
        assert vocab_split(x, 1000) == 960 and vocab_split(x, 1000, batch_invariant=True) is None
    sizes = {default_chunk(n, 50257, 512, 2, True) for n in (100, 5000, 100_000)}
    assert len(sizes) > 1  # the default reads N ...
    assert invariant_chunk(50257, 512, 2, True) == invariant_chunk(50257, 512, 2, True)  # ... this has no N to read
