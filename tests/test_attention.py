"""truefuse.attention (docs/attention.md): bounded against float64 (forward, dq, dk, dv), a row's
bits alone vs in a padded batch vs in decode, a deterministic backward, errors.

On the CPU fp32 runs the Triton kernels under the interpreter (conftest sets TRITON_INTERPRET=1)
and bf16 the row-invariant PyTorch path; on a GPU both run the kernels. Shapes are tiny: the
interpreter takes ~1 s per forward at these sizes.
"""

import pytest
import torch

import truefuse
from truefuse.ops.attention.attention_blocked import attention_blocked
from truefuse.ops.attention.attention_mask import first_valid_key
from truefuse.testing import assert_bitwise
from truefuse.verify.registry import all_cases

_NAMES = [c.name for c in all_cases(["attention"], "cpu")]


@pytest.mark.parametrize("name", _NAMES)
def test_registered_cases(device, name):
    """The contract (truefuse/verify/cases_attention.py): bounded against float64 (forward, dq, dk,
    dv: GQA, causal, a padding mask, softcap and window; fp32, bf16, fp16), a sequence alone vs in a
    left- and right-padded batch bitwise, decode steps vs one prefill bitwise, two backward runs
    bitwise. One test per case so that they spread over the suite's workers."""
    (case,) = [c for c in all_cases(["attention"], device.type) if c.name == name]
    failed = {k: r for k, r in case.fn(device).items() if not r.passed}
    assert not failed, failed


def _qkv(B, Hq, Hk, L, D, device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, h, L, D, generator=g).to(device, dtype) for h in (Hq, Hk, Hk))


def test_a_query_that_sees_no_key_gives_zeros(device):
    q, k, v = _qkv(1, 2, 2, 4, 16, device, torch.bfloat16)
    mask = torch.tensor([[True, True, False, False], [False] * 4, [True] * 4, [False, False, False, True]], device=device)
    out = truefuse.attention(q, k, v, attn_mask=mask)
    assert (out[:, :, 1] == 0).all() and torch.isfinite(out).all() and (out[:, :, 0] != 0).any()


def test_double_backward_is_refused_on_the_kernels(device):
    q, k, v = (t.requires_grad_() for t in _qkv(1, 1, 1, 8, 16, device, torch.float32))
    out = truefuse.attention(q, k, v)
    (dq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        dq.sum().backward()


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(dropout_p=0.1), "dropout_p"),
        (dict(k=torch.randn(1, 3, 4, 8), v=torch.randn(1, 3, 4, 8)), "enable_gqa"),
        (dict(v=torch.randn(1, 2, 5, 8)), "value"),
        (dict(attn_mask=torch.ones(3, 4, dtype=torch.bool)), "attn_mask"),
        (dict(attn_mask=torch.ones(4, 4, dtype=torch.int64)), "attn_mask"),
        (dict(softcap=-1.0), "softcap"),
        (dict(window=True), "window"),
        (dict(key_start=torch.zeros(2, dtype=torch.int32)), "key_start"),
        (dict(q=torch.randn(1, 2, 4, 8, dtype=torch.float16)), "query"),
    ],
)
def test_bad_input_is_refused_naming_the_argument(kw, match):
    args = {"q": torch.randn(1, 2, 4, 8), "k": torch.randn(1, 2, 4, 8), "v": torch.randn(1, 2, 4, 8)}
    for name in "qkv":
        if name in kw:
            args[name] = kw.pop(name)
    with pytest.raises((ValueError, TypeError), match=match):
        truefuse.attention(args["q"], args["k"], args["v"], **kw)


@pytest.mark.parametrize("L, pad, D", [(37, 11, 16), (150, 40, 64)])  # rows over 2 and 5 tiles, keys over 3 blocks
def test_pytorch_path_aligns_blocks_to_the_first_valid_key(L, pad, D):
    """The PyTorch path (bf16 on the CPU, where bf16 rounding hides fp32 differences) in fp32: a
    left-padded sequence's rows equal the sequence alone, decode equals prefill."""
    q, k, v = _qkv(1, 2, 1, L, D, "cpu", torch.float32, seed=4)
    mask = (torch.arange(L) >= pad)[None, None, None] & torch.ones(L, L, dtype=torch.bool).tril()
    start = first_valid_key(mask, 1, L, q.device)
    padded = attention_blocked(q, k, v, mask.expand(1, 2, L, L), start, 0.25, False, 0, 0.0)
    alone = attention_blocked(q[:, :, pad:], k[:, :, pad:], v[:, :, pad:], None, start * 0, 0.25, True, 0, 0.0)
    assert_bitwise(padded[:, :, pad:], alone, "left-padded rows")
    step = attention_blocked(q[:, :, -1:], k, v, None, start * 0, 0.25, False, 0, 0.0)
    assert_bitwise(step, attention_blocked(q, k, v, None, start * 0, 0.25, True, 0, 0.0)[:, :, -1:], "decode step")


def test_pytorch_path_products_are_fixed_shape_and_row_invariant():
    """What the PyTorch path's construction rests on (ops/attention/attention_blocked.py): a batched matmul of
    its fixed (BLOCK_M, D) x (D, BLOCK_N) shape gives a product the same bits alone, in any batch
    and at any place in it, and a row the same bits whatever the tile's other rows hold."""
    from truefuse.ops.attention.attention_blocked import BLOCK_M, block_n

    g = torch.Generator().manual_seed(7)
    for D, dtype in ((16, torch.float32), (64, torch.float32), (64, torch.float64)):
        n = block_n(D)
        a = torch.randn(40, BLOCK_M, D, generator=g).to(dtype)
        b = torch.randn(40, D, n, generator=g).to(dtype)
        full = torch.matmul(a, b)
        assert_bitwise(torch.matmul(a[5:6], b[5:6]), full[5:6], f"one product, D={D}")
        assert_bitwise(torch.matmul(a[3:10], b[3:10]), full[3:10], f"a smaller batch, D={D}")
        other = a.clone()
        other[:, 1:] = torch.randn(40, BLOCK_M - 1, D, generator=g).to(dtype)
        assert_bitwise(torch.matmul(other.roll(9, 1), b)[:, 9], full[:, 0], f"row 0 moved, other rows changed, D={D}")
        p = torch.rand(40, BLOCK_M, n, generator=g).to(dtype)  # probabilities @ V: (BLOCK_M, n) x (n, D)
        pv = torch.matmul(p, b.transpose(1, 2))
        assert_bitwise(torch.matmul(p[7:8], b[7:8].transpose(1, 2)), pv[7:8], f"P @ V alone, D={D}")


@pytest.mark.parametrize("D", [16, 64])
def test_pytorch_path_matches_the_reference_across_tiles(D):
    """fp64 against ``attention_ref``: query rows over several tiles (some holding two heads' rows),
    keys over several blocks, causal (its skipped blocks), a float mask with key_start, softcap and
    a window, GQA; the gradients too."""
    from truefuse.ops.attention.attention import attention_ref

    B, Hq, Hk, L = 2, 4, 2, 150 if D == 64 else 45
    q, k, v = (t.double().requires_grad_() for t in _qkv(B, Hq, Hk, L, D, "cpu", torch.float64, seed=5))
    pad = torch.tensor([0, 13])
    cols, causal = torch.arange(L)[None], torch.ones(L, L, dtype=torch.bool).tril()
    right = torch.where((cols < L - pad[:, None])[:, None, None] & causal, 0.0, float("-inf")).double()
    left = torch.where((cols >= pad[:, None])[:, None, None] & causal, 0.0, float("-inf")).double()
    for kw in (
        dict(is_causal=True),
        dict(attn_mask=right),
        dict(attn_mask=left, key_start=pad.int(), softcap=3.0, window=L // 3),
        dict(is_causal=True, softcap=3.0, window=L // 3),
    ):
        out = truefuse.attention(q, k, v, enable_gqa=True, **kw)
        ref = attention_ref(q, k, v, enable_gqa=True, **kw)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12, msg=lambda m, kw=kw: f"{list(kw)}: {m}")
        if "key_start" in kw:  # left padding: the reference's gradient is NaN on the rows that see no key
            continue
        g = torch.randn_like(out)
        for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_pytorch_path_ignores_autocast():
    """Its products stay fp32 under a bf16 autocast (the construction's fixed-shape invariance is
    checked for the fp32 BLAS only): the same bits as without it."""
    q, k, v = _qkv(2, 2, 1, 40, 16, "cpu", torch.float32, seed=6)
    start = torch.zeros(2, dtype=torch.int32)
    plain = attention_blocked(q, k, v, None, start, 0.25, True, 0, 0.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert_bitwise(attention_blocked(q, k, v, None, start, 0.25, True, 0, 0.0), plain, "under autocast")


def test_the_output_and_gradients_are_laid_out_as_the_inputs():
    """A transformers attention's q, k, v are (B, L, H, D) projections seen as (B, H, L, D): the
    output and the gradients keep that layout (as SDPA's flash kernels do), so the model's
    ``transpose(1, 2).contiguous()`` and its projections' backward copy nothing; the same values as
    from contiguous inputs."""
    from truefuse.ops.attention.attention import use_kernel

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 5, 4, 16, generator=g).transpose(1, 2).requires_grad_()
    k = torch.randn(2, 7, 2, 16, generator=g).transpose(1, 2).requires_grad_()
    v = torch.randn(2, 7, 2, 16, generator=g).transpose(1, 2).requires_grad_()
    if not use_kernel(q):
        pytest.skip("the kernels do not run here (TRITON_INTERPRET unset)")
    do = torch.randn(2, 4, 5, 16, generator=g)
    out = truefuse.attention(q, k, v, is_causal=True, enable_gqa=True)
    grads = torch.autograd.grad(out, (q, k, v), do)
    assert out.stride() == q.stride() and out.transpose(1, 2).is_contiguous()
    assert [t.stride() for t in grads] == [q.stride(), k.stride(), v.stride()]
    cq, ck, cv = (t.detach().contiguous().requires_grad_() for t in (q, k, v))
    ref = truefuse.attention(cq, ck, cv, is_causal=True, enable_gqa=True)
    assert ref.is_contiguous()
    assert_bitwise(out, ref, "output")
    for a, b in zip(grads, torch.autograd.grad(ref, (cq, ck, cv), do), strict=True):
        assert_bitwise(a, b, "gradient")


def test_overlapping_inputs_get_outputs_the_kernels_can_write():
    """A query whose heads overlap (strides (100, 1, 16, 1)): an output laid out as it would have a
    last stride of 4, which the kernels (three strides and a unit last one) cannot write; such an
    output is contiguous, forward and gradients right."""
    from truefuse.ops.attention.attention import attention_ref, use_kernel

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1000, generator=g).as_strided((2, 4, 5, 16), (100, 1, 16, 1))
    if not use_kernel(q):
        pytest.skip("the kernels do not run here (TRITON_INTERPRET unset)")
    kb = torch.randn(1000, generator=g, requires_grad=True)
    k = kb.as_strided((2, 4, 5, 16), (100, 1, 16, 1))
    v = torch.randn(2, 4, 5, 16, generator=g)
    out = truefuse.attention(q, k, v)
    ref = attention_ref(q.double(), k.double(), v.double())
    assert out.stride()[-1] == 1
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    do = torch.randn(2, 4, 5, 16, generator=g)
    (dk,) = torch.autograd.grad(out, kb, do)
    (dk_ref,) = torch.autograd.grad(attention_ref(q.double(), k.double(), v.double()), kb, do.double())
    torch.testing.assert_close(dk.double(), dk_ref.double(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "Lq, Lk, causal, softcap",
    [(37, 37, True, None), (37, 37, False, 20.0), (1, 37, False, None), (5, 37, False, None), (40, 40, True, 20.0)],
)
def test_launch_table_switches_keep_the_bits(device, monkeypatch, Lq, Lk, causal, softcap, dtype):
    """The launch table's switches that change how, not what, the kernels compute: ``full_blocks``
    (every pass skips the mask on the blocks every row sees whole, ``kernels/attention.py::_full_end``)
    and ``state_in_memory`` (the prefill forward's accumulator in memory between key chunks): the
    output and every gradient are the default's bits with either and both, causal or not, a
    sequence's keys starting past 0 (``key_start``), GQA, softcap, prefill and decode (the keys
    split across programs). Each setting on the device's own tiles (the interpreter's on the CPU; bf16 on the GPU only, where it
    runs the kernels and their tiles; on the GPU the sequences span two of its key chunks)."""
    import dataclasses

    import truefuse.ops.attention.attention as ops_attention
    from truefuse.ops.attention import attention_kept
    from truefuse.ops.attention.attention import use_kernel

    if dtype is torch.bfloat16 and device.type != "cuda":
        pytest.skip("bf16 runs the PyTorch path on the CPU")
    scale = 1 if device.type == "cpu" else 15  # on the GPU 555-600 keys: 64-key blocks, 512-key chunks
    Lq, Lk = (Lq if Lq == 1 else Lq * scale), Lk * scale
    D = 16 if device.type == "cpu" else 128
    q, k, v = _qkv(3, 4, 2, Lk, D, device, dtype, seed=9)
    q = q[:, :, Lk - Lq :].contiguous()
    if not use_kernel(q):
        pytest.skip("the kernels do not run here (TRITON_INTERPRET unset)")
    key_start = torch.tensor([0, 5, 13], dtype=torch.int32, device=device)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    base = ops_attention.attention_config
    runs = {}
    # on the CPU both switches together (each breaks it alone: tried); the GPU's tiles each on its own too
    settings = (
        ((False, False), (True, True)) if device.type == "cpu" else ((False, False), (True, False), (False, True), (True, True))
    )
    for full, in_memory in settings:
        cfg = dataclasses.replace(base(D, dtype, q.device.type == "cpu"), full_blocks=full, state_in_memory=in_memory)
        monkeypatch.setattr(ops_attention, "attention_config", lambda *a, cfg=cfg: cfg)
        attention_kept.clear()
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = truefuse.attention(*leaves, is_causal=causal, enable_gqa=True, softcap=softcap, key_start=key_start)
        run = (out, *torch.autograd.grad(out, leaves, do))
        with torch.no_grad():  # the no-grad forward (decode's split and kept launches)
            run += (truefuse.attention(q, k, v, is_causal=causal, enable_gqa=True, softcap=softcap, key_start=key_start),)
        runs[full, in_memory] = run
    attention_kept.clear()
    for switches, run in runs.items():
        for name, a, b in zip(("output", "dq", "dk", "dv", "no-grad output"), runs[False, False], run, strict=True):
            assert_bitwise(b, a, f"{name}, (full_blocks, state_in_memory) = {switches} vs the default")
