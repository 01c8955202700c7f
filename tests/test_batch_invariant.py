"""Batch-invariant mode (docs/design.md §1, "Batch invariance"; issue 34): under
``truefuse.batch_invariant()`` each row's result is bitwise the same whether it runs alone, in a
slice of the batch or in the whole call; the weight gradients are the same bits run to run.

On the CPU: the planner's row-block GEMM (fp32 and bf16), the Triton GEMM's fixed configuration in
fp32 under the interpreter (row prefixes: the interpreter's tl.dot is NumPy's, whose rows change
bits with their place in a tile, so only M is varied there), the Linear family, the norms, rope,
the gated activation, and the Hugging Face integration on tiny models. On the GPU (skipped on the
CPU): every tile of the mode's GEMM table gives the same bits, and rows of M = 1 … 1000 equal those
of M = 8192 (bf16, fp32); more in ``truefuse/bench/bench_bi_gemm.py``.
"""

from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import truefuse
from truefuse.ops.gemm.gemm import gemm, gemm_plan_for
from truefuse.ops.gemm.gemm_plan import Capability, override_capabilities

ROOT = Path(__file__).resolve().parents[1]
F32, BF16 = torch.float32, torch.bfloat16


@pytest.fixture(autouse=True)
def _one_thread():
    """One BLAS thread: these tests make hundreds of tiny GEMM calls, and on a loaded 2-core machine
    MKL's two threads waiting for each other took 20 ms a call instead of microseconds (a tiny
    model's step 2 s instead of 0.1 s). The bits of a fixed-shape call are compared within a test."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _t(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def _rows_invariant(fn, x, slices):
    """``fn`` on each slice of ``x``'s rows equals the same rows of ``fn(x)``, bit for bit."""
    full = fn(x)
    for sl in slices:
        got = fn(x[sl])
        assert torch.equal(got, full[sl]), f"rows {sl} differ from the whole call"
    return full


# ---------------------------------------------------------------------------------------------
# the switch


def test_switch_nests_restores_and_checks():
    assert not truefuse.is_batch_invariant()
    with truefuse.batch_invariant():
        assert truefuse.is_batch_invariant()
        with truefuse.batch_invariant(False):
            assert not truefuse.is_batch_invariant()
        assert truefuse.is_batch_invariant()
        with pytest.raises(RuntimeError), truefuse.batch_invariant(False):
            raise RuntimeError("boom")
        assert truefuse.is_batch_invariant()  # restored after the exception
    assert not truefuse.is_batch_invariant()
    with pytest.raises(TypeError, match="enabled must be a bool"):
        with truefuse.batch_invariant(1):
            pass


@pytest.mark.parametrize("value,expected", [("1", True), ("0", False)])
def test_switch_from_environment(value, expected):
    # config.py imports the standard library only: run it alone, no torch import (fast)
    code = f"import runpy; print(runpy.run_path({str(ROOT / 'truefuse' / 'config.py')!r})['is_batch_invariant']())"
    env = {"TRUEFUSE_BATCH_INVARIANT": value, "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(expected)
    assert runpy  # the same loader in-process would re-create the module's classes


# ---------------------------------------------------------------------------------------------
# the GEMM


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_gemm_rows_independent_of_m(dtype):
    """The planner's batch-invariant GEMM on the CPU (row blocks): forward (with bias) and the
    input-gradient form, rows for M = 1, 3, 64 and slices anywhere in the batch."""
    x, w, b = _t((100, 48), dtype, 1), _t((40, 48), dtype, 2), _t((40,), dtype, 3)
    slices = [slice(0, 1), slice(0, 3), slice(0, 64), slice(5, 6), slice(7, 27), slice(33, 100)]
    with truefuse.batch_invariant():
        p = gemm_plan_for(x, w.t())
        assert "batch_invariant" in p.split + p.fused, str(p)
        _rows_invariant(lambda t: gemm(t, w.t(), bias=b), x, slices)
        _rows_invariant(lambda t: gemm(t, w), _t((100, 40), dtype, 4), slices)  # dx = dy @ W
        # the explicit argument wins over the switch
        assert "batch_invariant" not in str(gemm_plan_for(x, w.t(), batch_invariant=False))
    assert "batch_invariant" in str(gemm_plan_for(x, w.t(), batch_invariant=True))


def test_plain_cpu_gemm_is_not_row_invariant():
    """Why the mode exists on the CPU: the BLAS picks another kernel for small M (fp32 rows of an
    M = 1 call differ from the same rows in a larger call; measured on the dev machine's MKL)."""
    x, w = _t((100, 48), F32, 1), _t((40, 48), F32, 2)
    full = gemm(x, w.t(), batch_invariant=False)
    assert any(not torch.equal(gemm(x[:m], w.t(), batch_invariant=False), full[:m]) for m in (1, 2, 3))


def test_gemm_bad_batch_invariant_argument():
    with pytest.raises(TypeError, match="batch_invariant must be None"):
        gemm(torch.ones(2, 2), torch.ones(2, 2), batch_invariant=1)


def test_triton_gemm_fixed_configuration_interpreter():
    """The Triton GEMM with batch-invariant mode's one configuration, fp32 in the interpreter:
    rows of M = 1, 3, 64 equal the same rows of M = 70 (tails in every tile dimension)."""
    from truefuse.ops.gemm.gemm_plan import backend_available

    if not backend_available("triton", "cpu"):
        pytest.skip("the Triton interpreter is off")
    x, w = _t((70, 40), F32, 5), _t((37, 40), F32, 6)
    row = Capability("batch_invariant", F32, F32, "cpu", backend="triton")
    with override_capabilities(backends=["triton"], add=[row]), truefuse.batch_invariant():
        assert str(gemm_plan_for(x, w.t())) == "triton[float32]: fused mm+batch_invariant"
        _rows_invariant(lambda t: gemm(t, w.t()), x, [slice(0, 1), slice(0, 3), slice(0, 64)])


def test_bi_table_fixed_block_k_and_every_m(monkeypatch):
    """The launch table of batch-invariant mode (``ops/gemm/gemm_bi_config.py``) has a tile for every M
    bucket of every (dtype, layout), and ``bi_config`` never changes BLOCK_K with M or layout."""
    import dataclasses

    import truefuse.ops.gemm.gemm_backends.triton as tb
    from truefuse.ops.gemm import gemm_bi_config as bc

    real = tb.get_config
    monkeypatch.setattr(tb, "get_config", lambda: dataclasses.replace(real(), triton_interpret=False))
    assert bc.M_BUCKETS[-1] is None and list(bc.M_BUCKETS[:-1]) == sorted(bc.M_BUCKETS[:-1])
    assert {k for k in bc.TABLE} == {(g, f) for g in ("bf16", "fp32") for f in ("nt", "nn")}
    for tiles in bc.TABLE.values():
        assert len(tiles) == len(bc.M_BUCKETS)
        for bm, bn, warps, stages in tiles:
            assert bm >= 16 and bn >= 16 and bm & (bm - 1) == 0 and bn & (bn - 1) == 0 and warps in (2, 4, 8) and stages >= 2
    for dtype, block_k in ((BF16, 64), (torch.float16, 64), (F32, 32)):
        for form in ("nt", "nn"):
            for M in (*range(1, 300), 511, 512, 513, 4096, 8192, 10**6):
                for N in (0, 4096, bc.WIDE_N, 14336):
                    cfg = tb.bi_config(dtype, M, form, N)
                    assert cfg.kwargs["BLOCK_K"] == block_k, (dtype, form, M, N)
    # a wide output's decode tile comes from WIDE, the rest from the table
    assert bc.bi_tiles(BF16, 1, "nn", 14336) == bc.WIDE[("bf16", "nn")][0] != bc.bi_tiles(BF16, 1, "nn", 4096)
    assert bc.bi_tiles(BF16, 8192, "nn", 14336) == bc.TABLE[("bf16", "nn")][-1]
    assert set(bc.WIDE[("bf16", "nn")]) <= set(bc.entries("bf16"))
    w = torch.ones(8, 4)
    assert bc.layout(w.t()) == "nt" and bc.layout(w) == "nn"


_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@_gpu
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_bi_table_entries_same_bits_gpu(dtype):
    """Every tile of the table (and the reference tile) gives every row the same bits, both B
    layouts, at a few (M, K, N): the GPU check that lets M choose the tile (docs/design.md §1)."""
    from truefuse.ops.gemm import gemm_bi_config as bc
    from truefuse.ops.gemm.gemm_backends.triton import run_tiles

    g = bc.group(dtype)
    tiles = [bc.REFERENCE[g], *bc.entries(g)]
    gen = torch.Generator(device="cuda").manual_seed(0)
    for M, K, N in ((1, 4096, 4096), (37, 1000, 3000), (300, 4096, 1024), (1024, 512, 14336)):
        a = torch.randn(M, K, generator=gen, device="cuda", dtype=dtype)
        w = torch.randn(N, K, generator=gen, device="cuda", dtype=dtype)
        for b in (w.t(), w.t().contiguous()):
            ref = run_tiles(a, b, tiles[0])
            for t in tiles[1:]:
                assert torch.equal(run_tiles(a, b, t), ref), (M, K, N, t, b.stride())


@_gpu
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_bi_gemm_small_m_rows_equal_large_m_gpu(dtype):
    """Rows of M = 1 … 64 (and across the table's bucket edges) through ``truefuse.gemm(...,
    batch_invariant=True)`` equal the same rows of the M = 8192 call, forward and input gradient."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    K, N = 1024, 4096
    w = torch.randn(N, K, generator=gen, device="cuda", dtype=dtype)
    wide = torch.randn(K, 14336, generator=gen, device="cuda", dtype=dtype)  # a WIDE decode tile's output
    for b, width in ((w.t(), K), (w, N), (wide, K)):
        x = torch.randn(8192, width, generator=gen, device="cuda", dtype=dtype)
        full = gemm(x, b, batch_invariant=True)
        for m in (1, 2, 3, 8, 16, 17, 32, 40, 64, 65, 256, 257, 1000):
            assert torch.equal(gemm(x[:m], b, batch_invariant=True), full[:m]), (m, b.stride())
        assert torch.equal(gemm(x[77:117], b, batch_invariant=True), full[77:117])


# ---------------------------------------------------------------------------------------------
# the Linear family: forward and input gradient per row, the mode kept for the backward


@pytest.fixture
def torch_paths(monkeypatch):
    """The norm and activation kernels on their PyTorch paths (the interpreter off): the kernels'
    own row invariance is tested op by op (tests/test_norm.py); here it is the layers' wiring."""
    import dataclasses

    import truefuse.ops._launch.triton as tr

    real = tr.get_config
    monkeypatch.setattr(tr, "get_config", lambda: dataclasses.replace(real(), triton_interpret=False))


def _fwd_bwd(module, x, dy):
    x = x.detach().requires_grad_()
    with truefuse.batch_invariant():
        y = module(x)
    # the backward after the block: it must take the forward's (batch-invariant) path
    (dx,) = torch.autograd.grad(y, x, dy)
    return y.detach(), dx


@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP"])
def test_linear_family_rows(kind, torch_paths):
    torch.manual_seed(0)
    if kind == "Linear":
        m = truefuse.Linear(48, 40)
    else:
        m = truefuse.LayerNormMLP(48, 64, normalization="RMSNorm", activation="swiglu")
    x, dy = _t((70, 48), F32, 7), _t((70, m(torch.zeros(1, 48)).shape[-1]), F32, 8)
    y, dx = _fwd_bwd(m, x, dy)
    for sl in (slice(0, 1), slice(0, 3), slice(9, 12), slice(0, 64)):
        ys, dxs = _fwd_bwd(m, x[sl], dy[sl])
        assert torch.equal(ys, y[sl]) and torch.equal(dxs, dx[sl]), f"{kind} rows {sl}"


# ---------------------------------------------------------------------------------------------
# norms, rope, activations: the reference paths the CPU runs, rows vs the whole call


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_elementwise_and_norm_ops_rows(dtype, torch_paths):
    x = _t((70, 64), dtype, 9)
    w = _t((64,), dtype, 10)
    sl = [slice(0, 1), slice(0, 3), slice(20, 23), slice(0, 64)]
    with truefuse.batch_invariant():
        _rows_invariant(lambda t: truefuse.rms_norm_hf(t, w, 1e-6, style="llama"), x, sl)
        _rows_invariant(lambda t: truefuse.rms_norm_hf(t, w, 1e-6, style="gemma"), x, sl)
        _rows_invariant(lambda t: truefuse.rms_norm(t, w, 1e-6), x, sl)
        _rows_invariant(lambda t: truefuse.layer_norm(t, w, w, 1e-5), x, sl)
        _rows_invariant(lambda t: truefuse.gated_activation(t, "swiglu"), x, sl)
        # rope: (batch, heads, seq, head_dim) with one token per batch entry, the tokens as rows
        cos, sin = _t((70, 1, 16), dtype, 11), _t((70, 1, 16), dtype, 12)
        q = _t((70, 2, 1, 16), dtype, 13)
        full = truefuse.apply_rotary_pos_emb(q, q, cos, sin)[0]
        for s in sl:
            assert torch.equal(truefuse.apply_rotary_pos_emb(q[s], q[s], cos[s], sin[s])[0], full[s])


# ---------------------------------------------------------------------------------------------
# Hugging Face: apply_truefuse(model, batch_invariant=True)


class _LoraLike(torch.nn.Module):
    """A LoRA wrapper as PEFT builds one: the base nn.Linear kept, two adapters added on top."""

    def __init__(self, base: torch.nn.Linear, r: int = 4):
        super().__init__()
        self.base_layer = base
        self.lora_A = torch.nn.Linear(base.in_features, r, bias=False)
        self.lora_B = torch.nn.Linear(r, base.out_features, bias=False)
        torch.nn.init.normal_(self.lora_B.weight)

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x)) * 0.5


def test_hf_linears_and_lora_run_batch_invariant(torch_paths):
    pytest.importorskip("transformers")
    from tests.hf.tiny import tiny_model
    from truefuse.integrations.huggingface import apply_truefuse, unpatch_truefuse
    from truefuse.integrations.huggingface.batch_invariant import running_batch_invariant

    model = tiny_model("llama")
    attn = model.model.layers[0].self_attn
    attn.q_proj = _LoraLike(attn.q_proj)
    report = apply_truefuse(model, batch_invariant=True)
    how = "truefuse Linear on the batch-invariant GEMM"
    assert report.batch_invariant[("nn.Linear q_proj", how)] == 1  # the other layer's; this one is wrapped
    assert report.batch_invariant[("nn.Linear base_layer", how)] == report.batch_invariant[("nn.Linear lora_A", how)] == 1
    assert report.batch_invariant[("nn.Linear down_proj", how)] == 2
    assert "batch-invariant" in str(report)
    assert type(attn.q_proj.base_layer) is torch.nn.Linear  # no class changed

    # the wrapper's rows under the model's mode: forward and input gradient
    x, dy = _t((40, 32), F32, 14), _t((40, 32), F32, 15)

    def fwd_bwd(rows):
        t = x[rows].clone().requires_grad_()
        with running_batch_invariant() as mode:
            y = attn.q_proj(t)
        (dx,) = torch.autograd.grad(y, t, dy[rows])
        return y.detach(), dx, mode.routed

    y, dx, routed = fwd_bwd(slice(0, 40))
    assert routed == 3  # base, lora_A, lora_B
    for rows in (slice(0, 1), slice(0, 3), slice(17, 20)):
        ys, dxs, _ = fwd_bwd(rows)
        assert torch.equal(ys, y[rows]) and torch.equal(dxs, dx[rows]), rows

    # the hooks: on inside the model's forward only, also after an exception
    seen = []

    def spy(m, a):
        seen.append(truefuse.is_batch_invariant())
        if len(seen) == 2:
            raise RuntimeError("boom")

    model.model.layers[0].mlp.register_forward_pre_hook(spy)
    model(torch.randint(0, 100, (1, 5)))
    assert seen == [True] and not truefuse.is_batch_invariant()
    with pytest.raises(RuntimeError, match="boom"):
        model(torch.randint(0, 100, (1, 5)))
    assert not truefuse.is_batch_invariant()
    unpatch_truefuse(model)
    seen[:] = [None, None]
    model(torch.randint(0, 100, (1, 5)))
    assert seen[2:] == [False]


def _train_twice(model_type):
    from tests.hf.tiny import tiny_model
    from truefuse.integrations.huggingface import apply_truefuse

    runs = []
    for _ in range(2):
        model = tiny_model(model_type)
        apply_truefuse(model, batch_invariant=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ids = torch.randint(0, 100, (3, 9), generator=torch.Generator().manual_seed(1))
        losses = []
        for _ in range(2):
            loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        runs.append((torch.stack(losses), [p.detach().clone() for p in model.parameters()]))
    return runs


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_hf_training_steps_are_bitwise_reproducible(model_type, torch_paths):
    """Two training steps of a patched tiny model, twice from the same seed: the same bits."""
    pytest.importorskip("transformers")
    (l1, p1), (l2, p2) = _train_twice(model_type)
    assert torch.equal(l1, l2)
    assert all(torch.equal(a, b) for a, b in zip(p1, p2, strict=True))


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_hf_moe_tokens_independent_of_batch(model_type, torch_paths):
    """The MoE block (router + experts + combine): each token's output and input gradient are the
    same bits alone, in a slice, or in the whole batch."""
    pytest.importorskip("transformers")
    from tests.hf.tiny import tiny_model
    from truefuse.integrations.huggingface import apply_truefuse
    from truefuse.integrations.huggingface.batch_invariant import running_batch_invariant

    model = tiny_model(model_type)
    apply_truefuse(model, batch_invariant=True)
    block = model.model.layers[0].mlp
    x, dy = _t((1, 40, 32), F32, 16), _t((1, 40, 32), F32, 17)

    def fwd_bwd(rows):
        t = x[:, rows].clone().requires_grad_()
        with running_batch_invariant():
            y = block(t)
        y = y[0] if isinstance(y, tuple) else y
        (dx,) = torch.autograd.grad(y, t, dy[:, rows])
        return y.detach(), dx

    y, dx = fwd_bwd(slice(0, 40))
    for rows in (slice(0, 1), slice(0, 3), slice(11, 30)):
        ys, dxs = fwd_bwd(rows)
        assert torch.equal(ys, y[:, rows]) and torch.equal(dxs, dx[:, rows]), rows


def test_router_ties_go_to_the_lowest_expert():
    pytest.importorskip("transformers")
    from tests.hf.tiny import tiny_model
    from truefuse.integrations.huggingface import apply_truefuse

    model = tiny_model("qwen3_moe")
    apply_truefuse(model, batch_invariant=True)
    gate = model.model.layers[0].mlp.gate
    with torch.no_grad():
        gate.weight.zero_()
        gate.weight[3, 0] = 1.0  # expert 3 first; experts 0, 1, 2 tie for second place
    _, scores, idx = gate(torch.ones(5, 32))
    assert idx.tolist() == [[3, 0]] * 5
    assert scores.dtype == torch.float32  # the tiny model's hidden dtype, as stock casts
