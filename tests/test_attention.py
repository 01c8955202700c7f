"""truefuse.attention (docs/attention.md): bounded against float64 (forward, dq, dk, dv), a row's
bits alone vs in a padded batch vs in decode, a deterministic backward, errors.

On the CPU fp32 runs the Triton kernels under the interpreter (conftest sets TRITON_INTERPRET=1)
and bf16 the row-invariant PyTorch path; on a GPU both run the kernels. Shapes are tiny: the
interpreter takes ~1 s per forward at these sizes.
"""

import pytest
import torch
import torch.nn.functional as F

import truefuse
from truefuse.ops.attention import attention_ref
from truefuse.testing import assert_bitwise, fwd_bwd_reports

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _qkv(B, Hq, Hk, L, D, device, dtype, seed=0, Lk=None):
    g = torch.Generator().manual_seed(seed)
    Lk = L if Lk is None else Lk
    q, k, v = (torch.randn(B, h, n, D, generator=g) for h, n in ((Hq, L), (Hk, Lk), (Hk, Lk)))
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype)


def _pad_mask(lengths, L, left, device):
    """(B, 1, 1, L) bool key mask: each sequence's tokens on the right (left padding) or left."""
    cols = torch.arange(L)
    rows = [(cols >= L - n) if left else (cols < n) for n in lengths]
    return torch.stack(rows)[:, None, None].to(device)


@pytest.mark.parametrize("dtype", DTYPES, ids=list(DTYPES))
@pytest.mark.parametrize("variant", ["causal_gqa_padded", "softcap_window"])
def test_bounded_against_float64(device, dtype, variant):
    q, k, v = _qkv(2, 2, 1, 18, 16, device, DTYPES[dtype])
    if variant == "causal_gqa_padded":
        # right padding, so that every query row sees a key (SDPA gives NaN on a row that sees none)
        mask = _pad_mask([18, 11], 18, left=False, device=device) & torch.ones(18, 18, dtype=torch.bool, device=device).tril()
        kw = dict(attn_mask=mask, enable_gqa=True)
        base = F.scaled_dot_product_attention
    else:
        kw = dict(is_causal=True, enable_gqa=True, softcap=5.0, window=7)
        base = attention_ref  # SDPA has neither option: the reference in the input dtype
    reps = fwd_bwd_reports(truefuse.attention, attention_ref, base, {"q": q, "k": k, "v": v}, **kw)
    assert set(reps) == {"out", "dq", "dk", "dv"}
    failed = {n: (r.error, r.baseline_error) for n, r in reps.items() if not r.passed}
    assert not failed, failed


@pytest.mark.parametrize("dtype", DTYPES, ids=list(DTYPES))
def test_a_row_alone_equals_the_row_in_a_padded_batch(device, dtype):
    L, lengths = 21, [21, 9, 14]
    q, k, v = _qkv(3, 2, 1, L, 16, device, DTYPES[dtype])
    causal = torch.ones(L, L, dtype=torch.bool, device=device).tril()
    for left in (True, False):
        out = truefuse.attention(q, k, v, attn_mask=_pad_mask(lengths, L, left, device) & causal, enable_gqa=True)
        for b, n in enumerate(lengths):
            sl = slice(L - n, L) if left else slice(0, n)
            alone = truefuse.attention(
                q[b : b + 1, :, sl], k[b : b + 1, :, sl], v[b : b + 1, :, sl], is_causal=True, enable_gqa=True
            )
            assert_bitwise(out[b : b + 1, :, sl], alone, f"sequence {b} (length {n}, {'left' if left else 'right'}-padded)")


@pytest.mark.parametrize("dtype", DTYPES, ids=list(DTYPES))
def test_decode_steps_equal_one_prefill(device, dtype):
    L = 19
    q, k, v = _qkv(1, 2, 2, L, 16, device, DTYPES[dtype], seed=1)
    prefill = truefuse.attention(q, k, v, is_causal=True)
    for t in (0, 16, L - 1):  # one new query against the cache of t + 1 keys
        step = truefuse.attention(q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1])
        assert_bitwise(step, prefill[:, :, t : t + 1], f"decode step {t}")
    t0 = 15  # a chunk of 3 queries against t0 + 3 keys, causal by mask (bottom-right)
    chunk_mask = torch.ones(3, t0 + 3, dtype=torch.bool, device=device).tril(t0)
    chunk = truefuse.attention(q[:, :, t0 : t0 + 3], k[:, :, : t0 + 3], v[:, :, : t0 + 3], attn_mask=chunk_mask)
    assert_bitwise(chunk, prefill[:, :, t0 : t0 + 3], "decode chunk of 3")


def test_two_backward_runs_are_bitwise_equal(device):
    q, k, v = _qkv(1, 2, 1, 20, 16, device, torch.float32, seed=2)
    grads = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = truefuse.attention(*leaves, is_causal=True, enable_gqa=True)
        out.backward(torch.ones_like(out))
        grads.append([t.grad for t in leaves])
    for name, a, b in zip("qkv", *grads, strict=True):
        assert_bitwise(a, b, f"d{name}")


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
