"""What the GPU compiler makes of the kernels whose contract is a stock function's bits, checked on
the CPU: Triton compiles them for a Hopper target (no GPU needed) and the PTX must hold no fused
multiply-add that the stock ops' separate roundings forbid: the rope kernel (transformers'
``apply_rotary_pos_emb``) and the norm kernel applying stock statistics (``rms_norm_hf``).

Why: Triton contracts a multiply and an add into an FMA (its default ``enable_fp_fusion``), through
casts too: with plain multiplies the rope kernel's bf16 ``round(round(x1*c1) - round(x2*s1))``
compiled to ``fma.rn.bf16`` (one rounding where transformers rounds twice; triton 3.9, sm_90).
``mul.rn`` by inline assembly keeps each product its own rounding; ``libdevice.mul_rn`` would too,
but flushes denormals (``mul.rn.ftz.f32``), which torch does not."""

import re

import pytest

pytest.importorskip("triton")

from _sm90 import compile_sm90  # noqa: E402

_INTS = ("T", "H", "sx_b", "sx_h", "sx_t", "sc_b", "sc_t", "so_b", "so_h", "so_t")
_CASES = [(dtype, backward) for dtype in ("bf16", "fp16", "fp32") for backward in (False, True)]
_HF = [(d, z, r) for d in ("bf16", "fp32") for z in (False, True) for r in (False, True)]


def _rope_spec(dtype: str, backward: bool) -> dict:
    sig = {k: "*" + dtype for k in ("x_ptr", "cos_ptr", "sin_ptr", "out_ptr")}
    sig.update(dict.fromkeys(_INTS, "i32"))
    const = {"HALF": 64, "BLOCK_H": 4, "BLOCK_D": 64, "BACKWARD": backward, "INTERPRETED": False}
    sig.update(dict.fromkeys(const, "constexpr"))
    return {"module": "truefuse.kernels.rope", "name": "_rope_kernel", "sig": sig, "const": const}


def _hf_norm_spec(dtype: str, zc: bool, rn: bool) -> dict:
    """The norm kernel as ``rms_norm_hf`` launches it with torch's statistics (``RSTD_IN``)."""
    import inspect

    from truefuse.kernels.norm import _norm_fwd_kernel

    const = dict(IS_RMS=True, HAS_W=True, HAS_B=False, ZERO_CENTERED=zc, BLOCK_N=4096, RSTD_IN=True, ROUND_NORMED=rn)
    sig = {}
    for n, p in inspect.signature(_norm_fwd_kernel.fn).parameters.items():
        if "constexpr" in str(p.annotation) or n in ("r_ptr", "s_ptr"):  # the residual pointers: None
            sig[n] = "constexpr"
            const.setdefault(n, None if p.default is inspect.Parameter.empty else p.default)
        elif n in ("x_ptr", "w_ptr", "b_ptr", "y_ptr"):
            sig[n] = "*" + dtype
        elif n.endswith("_ptr"):
            sig[n] = "*fp32"
        else:
            sig[n] = "fp32" if n == "eps" else "i32"
    return {"module": "truefuse.kernels.norm", "name": "_norm_fwd_kernel", "sig": sig, "const": const}


@pytest.fixture(scope="module")
def ptx() -> dict:
    keys = [f"{d} {b}" for d, b in _CASES] + [f"hf {d} {z} {r}" for d, z, r in _HF]
    specs = [_rope_spec(d, b) for d, b in _CASES] + [_hf_norm_spec(*c) for c in _HF]
    out = compile_sm90(specs)
    errors = [o["error"] for o in out if "error" in o]
    assert not errors, errors[:3]
    return {k: o["ptx"] for k, o in zip(keys, out, strict=True)}


@pytest.mark.parametrize(("dtype", "backward"), _CASES, ids=[f"{d}-{'bwd' if b else 'fwd'}" for d, b in _CASES])
def test_rope_rounds_every_product_on_its_own(ptx, dtype, backward):
    ptx = ptx[f"{dtype} {backward}"]
    fmas = re.findall(r"^\s*fma\.\S+", ptx, flags=re.M)
    assert not fmas, f"{dtype} {'backward' if backward else 'forward'}: products contracted into {sorted(set(fmas))}"
    muls = re.findall(r"^\s*mul\.\S*f32", ptx, flags=re.M)
    assert len(muls) == 8 and all(".ftz" not in m for m in muls), muls  # 4 products x 2 rows of the unrolled tile


@pytest.mark.parametrize(
    ("dtype", "zc", "rn"), _HF, ids=[f"{d}-{'gemma' if z else 'llama'}-{'round' if r else 'no-round'}" for d, z, r in _HF]
)
def test_stock_statistics_applied_without_an_fma(ptx, dtype, zc, rn):
    """``rms_norm_hf``'s kernel applying torch's statistics (``RSTD_IN``): ``x * rstd`` (rounded to
    x's dtype for Llama) times the weight (``1 + weight`` for Gemma): multiplies only, each rounded."""
    fmas = re.findall(r"^\s*fma\.\S+", ptx[f"hf {dtype} {zc} {rn}"], flags=re.M)
    assert not fmas, sorted(set(fmas))
