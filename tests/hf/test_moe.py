"""Hugging Face mixture-of-experts on truefuse (truefuse/integrations/huggingface/moe.py): tiny
Qwen3-MoE and Mixtral models on the CPU, patched experts against a deep copy left stock.

fp32: logits within 1e-5 relative and every parameter's gradient within 1e-5 relative (measured
≤ 7e-7; fp32 ε is 1.2e-7). bf16: bounded as docs/design.md §1 (error against float64 ≤ 1.25 × stock
bf16's + 1e-6); with an activation that is exact in bf16 (ReLU) the forward is bitwise stock's, which
pins the routing weights' rounding order.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import MixtralExperts  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts  # noqa: E402

from truefuse.integrations.huggingface import moe  # noqa: E402
from truefuse.integrations.huggingface.moe import EXPERT_CLASSES, find_experts, patch_experts  # noqa: E402

H, E, VOCAB = 32, 4, 128


def _config(arch: str, top_k: int = 2, **kw):
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(
            vocab_size=VOCAB,
            hidden_size=H,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=E,
            num_experts_per_tok=top_k,
            decoder_sparse_step=1,
            max_position_embeddings=64,
            initializer_range=0.2,
            **kw,
        )
    return MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=H,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=E,
        num_experts_per_tok=top_k,
        max_position_embeddings=64,
        initializer_range=0.2,
        **kw,
    )


_MODEL = {"qwen3_moe": Qwen3MoeForCausalLM, "mixtral": MixtralForCausalLM}
_EXPERTS = {"qwen3_moe": Qwen3MoeExperts, "mixtral": MixtralExperts}


def _set_impl(model_or_config, impl: str) -> None:
    """Select the stock experts implementation (skip where this transformers has no such switch)."""
    if isinstance(model_or_config, torch.nn.Module):
        if not hasattr(model_or_config, "set_experts_implementation"):
            pytest.skip("this transformers has no set_experts_implementation")
        model_or_config.set_experts_implementation(impl)
        cfg = model_or_config.config
    else:
        cfg = model_or_config
        cfg._experts_implementation = impl
    if getattr(cfg, "_experts_implementation", None) != impl:
        pytest.skip(f"this transformers does not dispatch experts_implementation={impl!r}")


def _model(arch: str, seed: int = 0, impl: str | None = None):
    torch.manual_seed(seed)
    m = _MODEL[arch](_config(arch))
    if impl is not None:
        _set_impl(m, impl)
    return m


def _patch_all(model) -> int:
    n = 0
    for _, e in find_experts(model):
        res = patch_experts(e)
        assert res, res.reason
        n += 1
    return n


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(seed))


# each architecture once, under each implementation once (the rounding rules of both are pinned
# bitwise per module below; two more model runs would double this file's time)
@pytest.mark.parametrize("arch,impl", [("qwen3_moe", "grouped_mm"), ("mixtral", "eager")])
def test_fp32_logits_and_every_gradient_match_stock(arch, impl, monkeypatch):
    stock = _model(arch, impl=impl)
    ours = copy.deepcopy(stock)
    assert _patch_all(ours) == 2
    pairs = zip(find_experts(ours), find_experts(stock), strict=True)
    assert all(type(e).__name__ == f"Truefuse{type(s).__name__}" for (_, e), (_, s) in pairs)

    calls = []
    real = moe.GroupedMLPFunction

    class Counting(real):
        @staticmethod
        def forward(ctx, *args):
            calls.append(1)
            return real.forward(ctx, *args)

    monkeypatch.setattr(moe, "GroupedMLPFunction", Counting)
    ids = _ids()
    out_s = stock(ids, labels=ids)
    out_t = ours(ids, labels=ids)
    assert len(calls) == 2  # one grouped MLP per MoE layer, nothing through stock's loop
    assert _rel(out_t.logits, out_s.logits) <= 1e-5
    out_s.loss.backward()
    out_t.loss.backward()
    for (name, ps), (name_t, pt) in zip(stock.named_parameters(), ours.named_parameters(), strict=True):
        assert name == name_t
        assert (ps.grad is None) == (pt.grad is None), name
        if ps.grad is not None:
            assert ps.grad.norm() > 0, name  # the comparison below would pass vacuously otherwise
            assert _rel(pt.grad, ps.grad) <= 1e-5, f"{name}: {_rel(pt.grad, ps.grad):.3e}"


def test_tolerance_catches_a_wrong_gate_up_order():
    """The 1e-5 check above can fail: reading gate_up_proj as [up, gate] moves the logits by ~50%."""
    stock = _model("mixtral")
    ours = copy.deepcopy(stock)
    _patch_all(ours)
    with torch.no_grad():
        for _, e in find_experts(ours):
            g, u = e.gate_up_proj.chunk(2, dim=1)
            e.gate_up_proj.copy_(torch.cat([u, g], dim=1))
        assert _rel(ours(_ids()).logits, stock(_ids()).logits) > 1e-2


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_parameters_and_state_dict_unchanged(arch):
    stock = _model(arch)
    ours = copy.deepcopy(stock)
    before = {n: p for n, p in ours.named_parameters()}
    _patch_all(ours)
    assert {n: p for n, p in ours.named_parameters()}.keys() == before.keys()
    assert all(p is before[n] for n, p in ours.named_parameters())  # the same tensors, not copies
    sd_s, sd_t = stock.state_dict(), ours.state_dict()
    assert list(sd_t) == list(sd_s)
    assert all(sd_t[k].shape == sd_s[k].shape and sd_t[k].dtype == sd_s[k].dtype for k in sd_s)
    # checkpoints go both ways, strictly
    fresh = _model(arch, seed=7)
    _patch_all(fresh)
    fresh.load_state_dict(sd_s, strict=True)
    assert all(torch.equal(fresh.state_dict()[k], sd_s[k]) for k in sd_s)
    _model(arch, seed=8).load_state_dict(sd_t, strict=True)
    # a patched model pickles (the subclass lives in the moe module) and stays patched
    e = next(iter(find_experts(pickle.loads(pickle.dumps(ours)))))[1]
    assert type(e) is type(next(iter(find_experts(ours)))[1]) and isinstance(e, _EXPERTS[arch])


def _experts(arch: str, *, top_k: int = 2, act: str = "silu", impl: str = "eager", dtype=torch.float32, seed: int = 0):
    """A stock experts module with O(1) outputs, and its patched copy."""
    cfg = _config(arch, top_k=top_k, hidden_act=act)
    _set_impl(cfg, impl)
    torch.manual_seed(seed)
    stock = _EXPERTS[arch](cfg)
    with torch.no_grad():
        stock.gate_up_proj.normal_(0, 0.3)
        stock.down_proj.normal_(0, 0.3)
    stock = stock.to(dtype)
    ours = copy.deepcopy(stock)
    res = patch_experts(ours)
    assert res, res.reason
    return stock, ours


def _routing(T: int, top_k: int, experts: int, w_dtype, seed: int = 2):
    """Distinct experts per token drawn from ``range(experts)``, and softmax weights."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(T)])
    w = torch.softmax(torch.randn(T, top_k, generator=g), dim=-1).to(w_dtype)
    return idx, w


def _run(module, x, idx, w, dy, autocast: bool = False):
    """Output and gradients (x, routing weights, gate_up_proj, down_proj) of one forward/backward
    (the forward under CPU bf16 autocast if asked, the backward outside it, as torch recommends)."""
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = module(x, idx, w)
    y.backward(dy.to(y.dtype))
    return y.detach(), x.grad, w.grad, module.gate_up_proj.grad, module.down_proj.grad


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_expert_without_tokens_gets_zero_gradient(arch):
    stock, ours = _experts(arch)
    idx, w = _routing(40, 2, E - 1, torch.float32)  # expert E-1 never routed to
    x = torch.randn(40, H, generator=torch.Generator().manual_seed(3))
    dy = torch.randn(40, H, generator=torch.Generator().manual_seed(4))
    got, want = _run(ours, x, idx, w, dy), _run(stock, x, idx, w, dy)
    for name, a, b in zip(("y", "dx", "dw_route", "dgate_up", "ddown"), got, want, strict=True):
        assert _rel(a, b) <= 1e-5, f"{name}: {_rel(a, b):.3e}"
    for p_t, p_s in ((got[3], want[3]), (got[4], want[4])):
        assert torch.count_nonzero(p_s[E - 1]) == 0  # stock's answer ...
        assert torch.count_nonzero(p_t[E - 1]) == 0  # ... and ours: exact zeros
        assert all(torch.count_nonzero(p_t[e]) > 0 for e in range(E - 1))


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_expert_parallel_sentinel_and_no_tokens(arch):
    """Index ``num_experts`` (an expert-parallel sentinel) contributes nothing, as in stock's loop;
    zero tokens give an empty output."""
    stock, ours = _experts(arch)
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(5))
    idx = torch.tensor([[0, E], [E, 1], [2, 3], [E, E], [1, 0]])
    w = torch.rand(5, 2, generator=torch.Generator().manual_seed(6))
    # stock's loop skips the sentinel in transformers 5.2x, and raises on it in 5.17 (one_hot):
    # its meaning is a slot with no contribution, i.e. any expert with weight 0
    sentinel = idx == E
    y_t, y_s = ours(x, idx, w), stock(x, idx.masked_fill(sentinel, 0), w.masked_fill(sentinel, 0.0))
    assert _rel(y_t, y_s) <= 1e-5
    assert torch.count_nonzero(y_t[3]) == 0
    y0 = ours(torch.randn(0, H), idx[:0], w[:0])
    assert y0.shape == (0, H)


@pytest.mark.parametrize("top_k", [2, 3])
@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_bf16_routing_rounding_is_stock(arch, impl, top_k):
    """With ReLU (exact in bf16, so ``relu(gate) * up`` rounds once in both) the only roundings left
    are the GEMMs' and the routing weights': the forward is bitwise stock's, and the rule of the
    other implementation would not be (top_k=3: eager rounds after each expert's add; Mixtral's
    fp32 weights: eager rounds each product to bf16 before the add)."""
    stock, ours = _experts(arch, top_k=top_k, act="relu", impl=impl, dtype=torch.bfloat16)
    w_dtype = torch.float32 if arch == "mixtral" else torch.bfloat16  # what each router hands over
    idx, w = _routing(64, top_k, E, w_dtype)
    x = torch.randn(64, H, generator=torch.Generator().manual_seed(3)).bfloat16()
    with torch.no_grad():
        y_s = stock(x, idx, w)
        assert torch.equal(ours(x, idx, w), y_s)
        if top_k == 3 or w_dtype != torch.bfloat16:  # otherwise both rules round once (moe.py)
            ours.config._experts_implementation = "grouped_mm" if impl == "eager" else "eager"
            assert not torch.equal(ours(x, idx, w), y_s)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_bf16_experts_bounded(arch):
    """SwiGLU in bf16: output and every gradient against the float64 stock module, ≤ 1.25 × stock
    bf16's error + 1e-6 (truefuse rounds ``silu(gate) * up`` once, stock twice)."""
    stock, ours = _experts(arch, dtype=torch.bfloat16)
    ref = copy.deepcopy(stock).double()
    w_dtype = torch.float32 if arch == "mixtral" else torch.bfloat16
    idx, w = _routing(64, 2, E, w_dtype)
    x = torch.randn(64, H, generator=torch.Generator().manual_seed(3))
    dy = torch.randn(64, H, generator=torch.Generator().manual_seed(4))
    r = _run(ref, x.double(), idx, w.double(), dy.double())
    s = _run(stock, x.bfloat16(), idx, w, dy.bfloat16())
    t = _run(ours, x.bfloat16(), idx, w, dy.bfloat16())
    for name, a, b, c in zip(("y", "dx", "dw_route", "dgate_up", "ddown"), t, s, r, strict=True):
        assert a.dtype == b.dtype, name
        err_t, err_s = _rel(a, c), _rel(b, c)
        assert 0 < err_s and err_t <= 1.25 * err_s + 1e-6, f"{name}: truefuse {err_t:.3e} vs stock {err_s:.3e}"


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_bf16_model_forward_bounded(arch):
    stock = _model(arch)
    ref = copy.deepcopy(stock).double()
    _set_impl(ref, "eager")  # grouped_mm has no float64 kernel
    stock = stock.bfloat16()
    ours = copy.deepcopy(stock)
    _patch_all(ours)
    with torch.no_grad():
        lr, ls, lt = ref(_ids()).logits, stock(_ids()).logits, ours(_ids()).logits
    assert lt.dtype == torch.bfloat16 and torch.isfinite(lt).all()
    err_t, err_s = _rel(lt, lr), _rel(ls, lr)
    assert err_t <= 1.25 * err_s + 1e-6, f"truefuse {err_t:.3e} vs stock {err_s:.3e}"


@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
def test_cpu_autocast_follows_stock(impl):
    """fp32 weights under bf16 autocast: eager's F.linear runs in bf16, grouped_mm in fp32; ours
    follows the configured one (bounded against float64), gradients back in fp32."""
    stock, ours = _experts("mixtral", impl=impl)
    ref = copy.deepcopy(stock).double()
    ref.config._experts_implementation = "eager"  # grouped_mm has no float64 kernel
    idx, w = _routing(48, 2, E, torch.float32)
    x = torch.randn(48, H, generator=torch.Generator().manual_seed(3))
    dy = torch.randn(48, H, generator=torch.Generator().manual_seed(4))
    r = _run(ref, x.double(), idx, w.double(), dy.double())
    s = _run(stock, x, idx, w, dy, autocast=True)
    t = _run(ours, x, idx, w, dy, autocast=True)
    for name, a, b, c in zip(("y", "dx", "dw_route", "dgate_up", "ddown"), t, s, r, strict=True):
        assert a.dtype == b.dtype, name
        err_t, err_s = _rel(a, c), _rel(b, c)
        assert err_t <= 1.25 * err_s + 1e-6, f"{name}: truefuse {err_t:.3e} vs stock {err_s:.3e}"
    err_y = _rel(t[0], r[0])
    assert (err_y > 1e-4) if impl == "eager" else (err_y < 1e-5)  # bf16 GEMMs vs fp32 GEMMs


def test_refusals_leave_the_module_stock():
    m = MixtralExperts(_config("mixtral", hidden_act="gelu_new"))  # (tanh GELU is geglu_tanh now)
    res = patch_experts(m)
    assert not res and "gelu_new" in res.reason and type(m) is MixtralExperts
    m = Qwen3MoeExperts(_config("qwen3_moe"))
    m.has_bias = True
    res = patch_experts(m)
    assert not res and "has_bias" in res.reason and type(m) is Qwen3MoeExperts
    assert moe.unsupported_reason(m) == res.reason
    res = patch_experts(torch.nn.Linear(4, 4))
    assert not res and "not one of the supported" in res.reason
    m = Qwen3MoeExperts(_config("qwen3_moe"))
    assert moe.unsupported_reason(m) == ""
    assert patch_experts(m) and patch_experts(m).activation == "swiglu"  # twice: still patched, same class
    assert type(m).__name__ == "TruefuseQwen3MoeExperts" and type(m).__mro__[1] is Qwen3MoeExperts
    assert set(EXPERT_CLASSES) == {"Qwen3MoeExperts", "MixtralExperts"}


def test_backend_option_reaches_the_kernel(monkeypatch):
    """``patch_experts(backend=)`` / ``apply_truefuse(experts_backend=)``: ``triton`` runs the Triton
    grouped GEMM (the interpreter here, fp32; on CUDA the default), ``per_group`` (the CPU's default)
    ``truefuse.gemm``; both bounded against stock; a bad value raises naming the argument."""
    import truefuse.autograd.grouped as ag
    from truefuse.integrations.huggingface import apply_truefuse
    from truefuse.ops.grouped_gemm.grouped_gemm import grouped_gemm_available

    calls = []
    real = ag.grouped_mm_rows
    monkeypatch.setattr(ag, "grouped_mm_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
    stock, ours = _experts("qwen3_moe")
    idx, w = _routing(24, 2, E, torch.float32)
    x = torch.randn(24, H, generator=torch.Generator().manual_seed(3))
    dy = torch.randn(24, H, generator=torch.Generator().manual_seed(4))
    want = _run(stock, x, idx, w, dy)
    cases = [(None, 0), ("per_group", 0)]
    if grouped_gemm_available(x.device, x.dtype):  # TRITON_INTERPRET=1
        cases.append(("triton", 4))  # fc1, fc2 forward; fc2, fc1 input gradient
    else:
        patch_experts(ours, backend="triton")
        with pytest.raises(ValueError, match="backend='per_group'"):
            ours(x, idx, w)
    for backend, n in cases:
        assert patch_experts(ours, backend=backend)
        calls.clear()
        got = _run(ours, x, idx, w, dy)
        assert len(calls) == n, backend
        for name, a, b in zip(("y", "dx", "dw_route", "dgate_up", "ddown"), got, want, strict=True):
            assert _rel(a, b) <= 1e-5, f"{backend} {name}: {_rel(a, b):.3e}"
    if torch.cuda.is_available():  # the default on CUDA is the Triton kernel
        assert patch_experts(ours, backend=None)
        calls.clear()
        y = ours.cuda()(x.cuda(), idx.cuda(), w.cuda())
        assert len(calls) == 2 and _rel(y.cpu(), want[0]) <= 1e-5
    with pytest.raises(ValueError, match="backend='tritn'"):
        patch_experts(ours, backend="tritn")
    model = _model("mixtral")
    with pytest.raises(ValueError, match="experts_backend='cublas'"):
        apply_truefuse(model, experts_backend="cublas")
    assert not any(type(e).__name__.startswith("Truefuse") for _, e in find_experts(model))  # nothing patched
    apply_truefuse(model, experts_backend="per_group")
    assert all(e._truefuse_backend == "per_group" for _, e in find_experts(model))


def test_device_splits_same_bits_as_host_splits(monkeypatch):
    """``backend='triton'`` keeps the per-expert counts on the device (no ``.tolist()``: no host sync,
    CUDA graphs); a module marked expert-parallel takes them to the host to drop its sentinels by
    count. Without sentinels both give the same bits; an unmarked module given a sentinel raises."""
    from truefuse.ops.grouped_gemm.grouped_gemm import grouped_gemm_available

    if not grouped_gemm_available(torch.device("cpu"), torch.float32):
        pytest.skip("the Triton grouped GEMM runs on the CPU only under TRITON_INTERPRET=1")
    made = []
    real = moe.split_offsets
    monkeypatch.setattr(moe, "split_offsets", lambda s, *a, **k: made.append(type(s)) or real(s, *a, **k))
    _, ours = _experts("qwen3_moe")
    assert patch_experts(ours, backend="triton")
    idx, w = _routing(24, 2, E, torch.float32)
    x = torch.randn(24, H, generator=torch.Generator().manual_seed(3))
    dy = torch.randn(24, H, generator=torch.Generator().manual_seed(4))
    on_device = _run(ours, x, idx, w, dy)
    assert made == [torch.Tensor]  # the offsets made from the device counts
    ours._is_expert_parallel = True
    on_host = _run(ours, x, idx, w, dy)
    assert made == [torch.Tensor]  # not again: the host list path
    for name, a, b in zip(("y", "dx", "dw_route", "dgate_up", "ddown"), on_device, on_host, strict=True):
        assert torch.equal(a, b), name
    idx[3, 1] = E
    assert torch.count_nonzero(ours(x, idx, w)[3]) > 0  # marked: the sentinel dropped, the other slot kept
    ours._is_expert_parallel = False
    with pytest.raises(RuntimeError, match="not marked expert-parallel"):
        ours(x, idx, w)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_experts_no_host_sync_and_graph_replay():
    """On CUDA the default backend runs the MoE experts forward + backward without a host sync
    (``set_sync_debug_mode('error')`` raises on one), gives the host-splits path's bits, and a CUDA
    graph of forward + backward replayed on a new routing gives eager's bits."""
    _, ours = _experts("qwen3_moe", dtype=torch.bfloat16)
    ours = ours.cuda()
    T, bf16 = 256, torch.bfloat16

    def inputs(seed):
        idx, w = _routing(T, 2, E, bf16, seed=seed)
        g = torch.Generator().manual_seed(seed)
        return [t.cuda() for t in (torch.randn(T, H, generator=g).to(bf16), idx, w, torch.randn(T, H, generator=g).to(bf16))]

    x, idx, w, dy = inputs(2)
    _run(ours, x, idx, w, dy)  # compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        on_device = _run(ours, x, idx, w, dy)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    ours._is_expert_parallel = True
    on_host = _run(ours, x, idx, w, dy)
    ours._is_expert_parallel = False
    for name, a, b in zip(("y", "dx", "dw_route", "dgate_up", "ddown"), on_device, on_host, strict=True):
        assert torch.equal(a, b), name

    sx, sidx, sw, sdy = x.clone().requires_grad_(), idx.clone(), w.clone().requires_grad_(), dy.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graph asks
        ours(sx, sidx, sw).backward(sdy)
    torch.cuda.current_stream().wait_stream(side)
    ours.zero_grad(set_to_none=True)
    sx.grad = sw.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sy = ours(sx, sidx, sw)
        sy.backward(sdy)
    captured = (sy, sx.grad, sw.grad, ours.gate_up_proj.grad, ours.down_proj.grad)
    x2, idx2, w2, dy2 = inputs(7)
    with torch.no_grad():
        for dst, src in zip((sx, sidx, sw, sdy), (x2, idx2, w2, dy2), strict=True):
            dst.copy_(src)
    graph.replay()
    replayed = [t.detach().clone() for t in captured]
    eager = _run(ours, x2, idx2, w2, dy2)
    for name, a, b in zip(("y", "dx", "dw_route", "dgate_up", "ddown"), replayed, eager, strict=True):
        assert torch.equal(a, b), name


def test_set_experts_implementation_is_honoured_after_patching(monkeypatch):
    """A patched model follows ``set_experts_implementation``: eager / batched_mm / grouped_mm stay on
    truefuse's grouped MLP (with their rounding rules), any other registered implementation runs
    as stock runs it (here a custom one, reached through transformers' interface), and choosing a
    mapped one again brings truefuse back."""
    from unittest.mock import Mock, patch

    moe_hf = pytest.importorskip("transformers.integrations.moe")
    if not hasattr(moe_hf, "ALL_EXPERTS_FUNCTIONS"):
        pytest.skip("this transformers has no experts interface")
    stock = _model("qwen3_moe", impl="eager")
    ours = copy.deepcopy(stock)
    assert _patch_all(ours) == 2
    calls = []
    real = moe.GroupedMLPFunction

    class Counting(real):
        @staticmethod
        def forward(ctx, *args):
            calls.append(1)
            return real.forward(ctx, *args)

    monkeypatch.setattr(moe, "GroupedMLPFunction", Counting)
    custom = Mock(wraps=moe_hf.ALL_EXPERTS_FUNCTIONS["batched_mm"])
    ids = _ids()
    with torch.no_grad(), patch.dict(moe_hf.ALL_EXPERTS_FUNCTIONS._global_mapping, {"tf_custom": custom}):
        for impl in ("batched_mm", "tf_custom", "grouped_mm"):
            _set_impl(stock, impl)
            _set_impl(ours, impl)
            calls.clear()
            custom.reset_mock()
            got, want = ours(ids).logits, stock(ids).logits
            if impl == "tf_custom":  # stock's own dispatch, on both: the same call, the same bits
                assert not calls and custom.call_count == 4 and torch.equal(got, want)
            else:
                assert len(calls) == 2 and not custom.called and _rel(got, want) <= 1e-5, impl
