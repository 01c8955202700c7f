"""The batch-invariant grouped GEMM (truefuse/ops/grouped_gemm/grouped_gemm.py) and the grouped modules on it
(``backend="triton"``): bounded against one GEMM per group, each group's bits independent of the
other groups and of the batch, device-tensor splits equal to host lists, empty and one-row groups,
main_grad accumulation, no host read of the sizes. On the CPU under Triton's interpreter, in fp32."""

import pytest
import torch

import truefuse
from truefuse.ops.grouped_gemm.grouped_gemm import (
    grouped_bias_grad,
    grouped_gemm_available,
    grouped_gemm_ref,
    grouped_gemm_wgrad_ref,
    grouped_mm_rows,
    grouped_mm_wgrad,
    split_offsets,
)
from truefuse.testing import assert_bitwise, bounded_report
from truefuse.verify.registry import all_cases

K, N = 24, 20
SPLITS = [5, 0, 1, 19, 3]  # an empty group, a one-row group, a group of several tiles


@pytest.fixture
def dev(device):
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    if not grouped_gemm_available(device, dt):
        pytest.skip("the grouped GEMM runs on CUDA, or on the CPU only under TRITON_INTERPRET=1")
    return device


def _dtype(device):
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _rand(*shape, seed, device, dtype):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


def _operands(splits, device, seed=0, dtype=None):
    dtype = dtype or _dtype(device)
    M, G = sum(splits), len(splits)
    x = _rand(M, K, seed=seed, device=device, dtype=dtype)
    w = _rand(G, N, K, seed=seed + 1, device=device, dtype=dtype)
    b = _rand(G, N, seed=seed + 2, device=device, dtype=dtype)
    dy = _rand(M, N, seed=seed + 3, device=device, dtype=dtype)
    return x, w, b, dy


def _run(x, w, b, dy, splits):
    """(y, dx, dW, db) through the grouped GEMM with a host list of splits."""
    off = split_offsets(splits, len(splits), x.shape[0], x.device)
    return (
        grouped_mm_rows(x, w, off, transpose_w=True, bias=b),
        grouped_mm_rows(dy, w, off, transpose_w=False),
        grouped_mm_wgrad(dy, x, off),
        grouped_bias_grad(dy, off),
    )


def _ref(x, w, b, dy, splits):
    db = torch.stack([dy[s].sum(0) for s in _slices(splits)])
    return (
        grouped_gemm_ref(x, w, splits, bias=b),
        grouped_gemm_ref(dy, w, splits, transpose_w=False),
        grouped_gemm_wgrad_ref(dy, x, splits),
        db,
    )


def _slices(splits):
    start = 0
    for m in splits:
        yield slice(start, start + m)
        start += m


def test_bounded_against_one_gemm_per_group(dev):
    ops = _operands(SPLITS, dev)
    got = _run(*ops, SPLITS)
    base = _ref(*ops, SPLITS)
    ref64 = _ref(*(t.cpu().double() for t in ops), SPLITS)
    for name, g, b, r in zip(("y", "dx", "dW", "db"), got, base, ref64, strict=True):
        rep = bounded_report(g, r, b)
        assert rep.passed, f"{name}: {rep}"
    assert not got[2][1].any(), "an empty group's dW is zero"


def test_a_wrong_result_fails_the_bound(dev):
    """The check above can fail: one group's weights taken from its neighbour is caught."""
    x, w, b, dy = _operands(SPLITS, dev)
    off = split_offsets(SPLITS, len(SPLITS), x.shape[0], x.device)
    w_shift = torch.roll(w, 1, dims=0)
    y = grouped_mm_rows(x, w_shift, off, transpose_w=True, bias=b)
    rep = bounded_report(
        y,
        grouped_gemm_ref(x.cpu().double(), w.cpu().double(), SPLITS, bias=b.cpu().double()),
        grouped_gemm_ref(x, w, SPLITS, bias=b),
    )
    assert not rep.passed


def _group_view(outs, splits, g):
    s = list(_slices(splits))[g]
    y, dx, dw, db = outs
    return y[s], dx[s], dw[g], db[g]


def _check_group_invariant(outs_a, splits_a, ga, outs_b, splits_b, gb, what):
    for name, a, b in zip(
        ("y", "dx", "dW", "db"), _group_view(outs_a, splits_a, ga), _group_view(outs_b, splits_b, gb), strict=True
    ):
        assert_bitwise(a, b, f"{what}: group {ga}/{gb} {name}")


def _batch(parts, device, seed=10):
    """Operands built from per-group pieces: parts[g] = (x_g, dy_g, w_g, b_g)."""
    x = torch.cat([p[0] for p in parts])
    dy = torch.cat([p[1] for p in parts])
    w = torch.stack([p[2] for p in parts])
    b = torch.stack([p[3] for p in parts])
    return x, w, b, dy


def _pieces(sizes, device, seed=10):
    dt = _dtype(device)
    return [
        (
            _rand(m, K, seed=seed + 4 * g, device=device, dtype=dt),
            _rand(m, N, seed=seed + 4 * g + 1, device=device, dtype=dt),
            _rand(N, K, seed=seed + 4 * g + 2, device=device, dtype=dt),
            _rand(N, seed=seed + 4 * g + 3, device=device, dtype=dt),
        )
        for g, m in enumerate(sizes)
    ]


def test_invariant_to_the_order_of_the_groups(dev):
    parts = _pieces(SPLITS, dev)
    outs = _run(*_batch(parts, dev), SPLITS)
    perm = [3, 0, 4, 2, 1]
    p_parts = [parts[i] for i in perm]
    p_splits = [SPLITS[i] for i in perm]
    p_outs = _run(*_batch(p_parts, dev), p_splits)
    for new, old in enumerate(perm):
        _check_group_invariant(outs, SPLITS, old, p_outs, p_splits, new, "permuted experts")


def test_invariant_to_the_other_groups_sizes(dev):
    """Group 3 keeps its rows; tokens move between the other groups (and the total changes)."""
    parts = _pieces(SPLITS, dev)
    outs = _run(*_batch(parts, dev), SPLITS)
    for other_sizes in ([0, 7, 0, None, 30], [17, 2, 3, None, 0], [1, 1, 1, None, 1]):
        sizes = [SPLITS[3] if s is None else s for s in other_sizes]
        new = _pieces(sizes, dev, seed=99)
        new[3] = parts[3]
        _check_group_invariant(outs, SPLITS, 3, _run(*_batch(new, dev), sizes), sizes, 3, f"other sizes {sizes}")


def test_a_group_alone_equals_the_group_in_the_batch(dev):
    parts = _pieces(SPLITS, dev)
    outs = _run(*_batch(parts, dev), SPLITS)
    for g in range(len(SPLITS)):
        alone = _run(*_batch([parts[g]], dev), [SPLITS[g]])
        _check_group_invariant(outs, SPLITS, g, alone, [SPLITS[g]], 0, "alone")


def test_the_batch_split_in_two(dev):
    """The experts spread over two batches (each expert's tokens in one of them, the others empty
    there): every expert's rows, dW and db are those of the whole batch."""
    parts = _pieces(SPLITS, dev)
    outs = _run(*_batch(parts, dev), SPLITS)
    zero = [(p[0][:0], p[1][:0], p[2], p[3]) for p in parts]
    for half in ({0, 2, 3}, {1, 4}):
        sizes = [m if g in half else 0 for g, m in enumerate(SPLITS)]
        sub = [parts[g] if g in half else zero[g] for g in range(len(SPLITS))]
        sub_outs = _run(*_batch(sub, dev), sizes)
        for g in half:
            _check_group_invariant(outs, SPLITS, g, sub_outs, sizes, g, f"half {sorted(half)}")


def test_device_tensor_splits_equal_a_host_list(dev):
    x, w, b, dy = _operands(SPLITS, dev)
    host = split_offsets(SPLITS, len(SPLITS), x.shape[0], x.device)
    for t in (torch.tensor(SPLITS, device=dev), torch.tensor(SPLITS, dtype=torch.int32, device=dev), torch.tensor(SPLITS)):
        off = split_offsets(t, len(SPLITS), x.shape[0], x.device)
        assert off.dtype == torch.int64 and off.device == x.device and torch.equal(off.cpu(), host.cpu())
        assert_bitwise(
            grouped_mm_rows(x, w, off, transpose_w=True, bias=b), grouped_mm_rows(x, w, host, transpose_w=True, bias=b)
        )
        assert_bitwise(grouped_mm_wgrad(dy, x, off), grouped_mm_wgrad(dy, x, host))


@pytest.mark.parametrize("splits", [[0, 0, 7, 0], [1, 1, 1, 1], [0, 0, 0, 0], [16, 0, 17, 0]])
def test_empty_and_one_row_groups(splits, dev):
    ops = _operands(splits, dev, seed=3)
    got = _run(*ops, splits)
    ref = _ref(*ops, splits)
    ref64 = _ref(*(t.cpu().double() for t in ops), splits)
    for name, g, b, r in zip(("y", "dx", "dW", "db"), got, ref, ref64, strict=True):
        assert g.shape == b.shape, name
        assert bounded_report(g, r, b).passed, name
    for gi, m in enumerate(splits):
        if m == 0:
            assert not got[2][gi].any() and not got[3][gi].any()


def test_main_grad_accumulation(dev):
    x, w, b, dy = _operands(SPLITS, dev)
    off = split_offsets(SPLITS, len(SPLITS), x.shape[0], x.device)
    start = torch.randn(len(SPLITS), N, K, generator=torch.Generator().manual_seed(7)).to(dev)
    start[1] = -0.0  # the empty group's slice is left as it is, signs included
    mg = start.clone()
    grouped_mm_wgrad(dy, x, off, out=mg, accumulate=True)
    fresh = grouped_mm_wgrad(dy, x, off, out_dtype=torch.float32)
    want = start + fresh
    want[1] = start[1]  # an empty group: untouched, not -0.0 + 0.0
    assert_bitwise(mg, want, "main_grad += dW (one fp32 add)")
    assert torch.signbit(mg[1]).all()
    # overwrite (beta=0) into fp32
    out = torch.full_like(start, float("nan"))
    grouped_mm_wgrad(dy, x, off, out=out)
    assert_bitwise(out, fresh)


@pytest.mark.parametrize("accumulate", [False, True])
def test_tma_epilogue_equals_the_pointer_epilogue(accumulate, dev):
    """The Hopper weight-gradient kernel's output through a TMA descriptor (whole tile, halves,
    quarters; N and K tails, several tiles per program) writes, or adds into main_grad, the pointer
    epilogue's bits; an empty group's main_grad is left alone (signs included). The CPU: the
    interpreter, fp16 operands."""
    from truefuse.ops.grouped_gemm import grouped_gemm as gg
    from truefuse.ops.grouped_gemm import grouped_gemm_config as ggc

    if dev.type == "cuda" and torch.cuda.get_device_capability(dev) < (9, 0):
        pytest.skip("TMA descriptors need sm_90")
    cuda = dev.type == "cuda"
    dt = torch.bfloat16 if cuda else torch.float16
    splits, n, k = ([130, 0, 1, 257, 3], 200, 328) if cuda else ([5, 0, 19, 33, 3], 40, 96)
    G, M = len(splits), sum(splits)
    dy, x = _rand(M, n, seed=1, device=dev, dtype=dt), _rand(M, k, seed=2, device=dev, dtype=dt)
    off = split_offsets(splits, G, M, dev)
    odt = torch.float32 if accumulate else dt
    start = _rand(G, n, k, seed=3, device=dev, dtype=odt)
    start[1] = -0.0
    got = []
    for epi, split in ((False, 1), (True, 1), (True, 2), (True, 4)):
        blocks = (64, 32, 32, 4, 2) if cuda else (16, 16, 32, 4, 1)  # CUDA: 385 tiles, 2-3 per program
        cfg = ggc.TileConfig(*blocks, programs_per_sm=1, tma=True, tma_epilogue=epi, epilogue_split=split)
        out = start.clone() if accumulate else torch.full_like(start, float("nan"))
        gg._launch_wgrad(dy, x, off, out, accumulate, cfg)
        got.append(out)
    for out, split in zip(got[1:], (1, 2, 4), strict=True):
        assert_bitwise(out, got[0], f"TMA epilogue in {split} part(s)")
    assert torch.signbit(got[1][1]).all() if accumulate else not got[1][1].any()


def test_bad_input_is_named(dev):
    x, w, b, dy = _operands(SPLITS, dev)
    off = split_offsets(SPLITS, len(SPLITS), x.shape[0], x.device)
    with pytest.raises(TypeError, match="offsets must be int64"):
        grouped_mm_rows(x, w, off.int(), transpose_w=True)
    with pytest.raises(ValueError, match="offsets has 4 entries but there are 5 groups"):
        grouped_mm_rows(x, w, off[:4], transpose_w=True)
    with pytest.raises(ValueError, match="x has 24 columns"):
        grouped_mm_rows(x, w, off, transpose_w=False)
    with pytest.raises(ValueError, match="bias has shape"):
        grouped_mm_rows(x, w, off, transpose_w=True, bias=b[:, :3])
    with pytest.raises(ValueError, match="w must be 3-D"):
        grouped_mm_rows(x, w[0], off, transpose_w=True)
    with pytest.raises(ValueError, match="accumulate=True adds into an existing output"):
        grouped_mm_wgrad(dy, x, off, accumulate=True)
    with pytest.raises(ValueError, match="out has shape"):
        grouped_mm_wgrad(dy, x, off, out=torch.zeros(5, K, N, device=dev))
    with pytest.raises(ValueError, match="dy has 28 rows but x has 27"):
        grouped_mm_wgrad(dy, x[:-1], off)
    with pytest.raises(TypeError, match="x has dtype torch.int64"):
        grouped_mm_rows(x.long(), w, off, transpose_w=True)
    with pytest.raises(ValueError, match="m_splits sums to 27 but the number of rows of x is 28"):
        split_offsets([5, 0, 1, 18, 3], 5, 28, x.device)
    with pytest.raises(ValueError, match="m_splits has 4 groups but there are 5"):
        split_offsets(torch.tensor([5, 0, 1, 22], device=dev), 5, 28, x.device)
    if dev.type == "cpu":  # a device-side assert on CUDA (not recoverable in-process)
        with pytest.raises(ValueError, match="m_splits sums to 27"):
            split_offsets(torch.tensor([5, 0, 1, 18, 3]), 5, 28, x.device)


# ---------------------------------------------------------------------------------------------
# The modules on the backend


def _modules(cls, backend, device, **kw):
    torch.manual_seed(0)
    return cls(4, 16, 12, single_grouped_weight=True, device=device, backend=backend, **kw)


def _fwd_bwd(m, x, splits, dy):
    """Output, input gradient and each parameter's gradient (``main_grad`` where the module fuses
    it; after ``backward_dw()`` where it delays)."""
    xx = x.clone().requires_grad_()
    for p in m.parameters():
        p.grad = None
    y = m(xx, splits)
    y.backward(dy)
    if m._wgrad.delay_wgrad_compute:
        m.backward_dw()
    fused = {id(p) for _, p in m.gemm_weights()} if m._wgrad.fuse_wgrad_accumulation else set()
    grads = {n: (p.main_grad if id(p) in fused else p.grad).clone() for n, p in m.named_parameters()}
    return {"y": y.detach(), "dx": xx.grad, **grads}


MSPLITS = [5, 0, 1, 9]


@pytest.mark.parametrize("cls", [truefuse.GroupedLinear, truefuse.GroupedMLP])
@pytest.mark.parametrize("mode", ["plain", "main_grad", "delayed"])
def test_module_triton_vs_per_group(cls, mode, dev):
    """Bounded against the float64 per-group module, with the fp32 per-group module as the baseline;
    the weight-gradient contract (main_grad accumulation, delayed) as with the per-group backend."""
    kw = {"bias": True, "fuse_wgrad_accumulation": mode == "main_grad", "delay_wgrad_compute": mode == "delayed"}
    tri = _modules(cls, "triton", dev, **kw)
    per = _modules(cls, "per_group", dev, **kw)
    per.load_state_dict(tri.state_dict())
    ref = _modules(cls, "per_group", "cpu", bias=True).double()
    ref.load_state_dict(tri.state_dict())
    x = _rand(15, 16, seed=1, device=dev, dtype=torch.float32)
    dy = _rand(15, 16 if cls is truefuse.GroupedMLP else 12, seed=2, device=dev, dtype=torch.float32)
    for m in (tri, per):
        for _, p in m.gemm_weights():
            p.main_grad = torch.ones(p.shape, device=dev)  # fused: accumulated onto ones
    got, base = _fwd_bwd(tri, x, MSPLITS, dy), _fwd_bwd(per, x, MSPLITS, dy)
    want = _fwd_bwd(ref, x.cpu().double(), MSPLITS, dy.cpu().double())
    if mode == "main_grad":
        for n, _ in tri.gemm_weights():
            want[n] = want[n] + 1
    assert got.keys() == want.keys()
    for k in want:
        rep = bounded_report(got[k], want[k], base[k])
        assert rep.passed, f"{k}: {rep}"


@pytest.mark.parametrize("cls", [truefuse.GroupedLinear, truefuse.GroupedMLP])
def test_module_tensor_splits_never_read_on_the_host(cls, dev, monkeypatch):
    """Forward and backward with a tensor of sizes: no ``tolist``/``item`` on any tensor (on CUDA the
    sync they would cost is what CUDA graphs and overlap forbid)."""
    m = _modules(cls, "triton", dev, bias=True)
    x = _rand(15, 16, seed=1, device=dev, dtype=_dtype(dev)).requires_grad_()
    m.to(x.dtype)
    splits = torch.tensor(MSPLITS, device=dev)
    want = _fwd_bwd(m, x.detach(), MSPLITS, torch.ones(15, 16 if cls is truefuse.GroupedMLP else 12, device=dev, dtype=x.dtype))

    def refuse(*a, **k):
        raise AssertionError("read on the host")

    monkeypatch.setattr(torch.Tensor, "tolist", refuse)
    monkeypatch.setattr(torch.Tensor, "item", refuse)
    got = _fwd_bwd(m, x.detach(), splits, torch.ones_like(want["y"]))
    monkeypatch.undo()
    for k in want:
        assert_bitwise(got[k], want[k], k)


def test_module_backend_option_and_errors(device):
    with pytest.raises(ValueError, match="backend='triton' needs packed weights"):
        truefuse.GroupedLinear(2, 8, 4, backend="triton")
    with pytest.raises(ValueError, match="backend='cuda' is not supported"):
        truefuse.GroupedMLP(2, 8, 4, backend="cuda", single_grouped_weight=True)
    with pytest.raises(ValueError, match="conflicts with backend='triton'"):
        truefuse.GroupedLinear(2, 8, 4, backend="triton", fused_grouped_gemm=True, single_grouped_weight=True)
    m = truefuse.GroupedLinear(2, 8, 4, fused_grouped_gemm=True, single_grouped_weight=True, device=device)
    assert m.backend == "cublas_grouped" and m.fused_grouped_gemm
    m.fused_grouped_gemm = False
    assert m.backend is None
    if device.type == "cpu":
        # the default on the CPU stays one GEMM per group; float64 has no Triton path
        d = truefuse.GroupedLinear(2, 8, 4, single_grouped_weight=True, dtype=torch.float64)
        assert d._resolve_path(torch.device("cpu"), torch.float32, True) == "per_group"
        t = truefuse.GroupedLinear(2, 8, 4, single_grouped_weight=True, dtype=torch.float64, backend="triton")
        with pytest.raises(ValueError, match="backend='triton' runs on CUDA"):
            t(torch.randn(3, 8, dtype=torch.float64), [1, 2])


def test_registered_cases_pass(dev):
    for case in all_cases(["grouped_gemm"], dev.type):
        for label, rep in case.fn(dev).items():
            assert rep.passed, f"{case.name}/{label}: {rep}"


def test_triton_mlp_keeps_only_input_and_fc1_output(dev):
    """The offsets ride on ctx: the saved activations stay x and fc1's output."""
    m = truefuse.GroupedMLP(3, 32, 24, device=dev, single_grouped_weight=True, backend="triton")
    x = torch.randn(20, 32, device=dev, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = m(x, torch.tensor([5, 0, 15], device=dev))
    params = {id(p) for p in m.parameters()}
    assert sorted(tuple(t.shape) for t in saved if id(t) not in params) == [(20, 32), (20, 48)]
    y.sum().backward()
    assert x.grad is not None and all(p.grad is not None for p in m.parameters())
