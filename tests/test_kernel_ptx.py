"""What the GPU compiler makes of the kernels whose contract is a stock function's bits, checked on
the CPU: Triton compiles them for a Hopper target (no GPU needed) and the PTX must hold no fused
multiply-add that the stock ops' separate roundings forbid: the rope kernel (transformers'
``apply_rotary_pos_emb``) and the norm kernel applying stock statistics (``rms_norm_hf``).

Why: Triton contracts a multiply and an add into an FMA (its default ``enable_fp_fusion``), through
casts too: with plain multiplies the rope kernel's bf16 ``round(round(x1*c1) - round(x2*s1))``
compiled to ``fma.rn.bf16`` (one rounding where transformers rounds twice; triton 3.9, sm_90).
``mul.rn`` by inline assembly keeps each product its own rounding; ``libdevice.mul_rn`` would too,
but flushes denormals (``mul.rn.ftz.f32``), which torch does not."""

import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("triton")

_INTS = ("T", "H", "sx_b", "sx_h", "sx_t", "sc_b", "sc_t", "so_b", "so_h", "so_t")
_CASES = [(dtype, backward) for dtype in ("bf16", "fp16", "fp32") for backward in (False, True)]

# compiled in a process of its own: the suite runs Triton's interpreter (TRITON_INTERPRET=1), under
# which the kernels are interpreted functions that compile to nothing
_COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from truefuse.kernels.rope import _rope_kernel
ints, cases, out = json.loads(sys.argv[1]), json.loads(sys.argv[2]), {}
for dtype, backward in cases:
    sig = {k: "*" + dtype for k in ("x_ptr", "cos_ptr", "sin_ptr", "out_ptr")}
    sig.update(dict.fromkeys(ints, "i32"))
    const = {"HALF": 64, "BLOCK_H": 4, "BLOCK_D": 64, "BACKWARD": backward, "INTERPRETED": False}
    sig.update(dict.fromkeys(const, "constexpr"))
    names = list(sig)
    src = ASTSource(_rope_kernel, sig, {(names.index(k),): v for k, v in const.items()})
    out[f"{dtype} {backward}"] = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
import truefuse.kernels.norm as K
for dtype, zc, rn in [(d, z, r) for d in ("bf16", "fp32") for z in (False, True) for r in (False, True)]:
    const = dict(IS_RMS=True, HAS_W=True, HAS_B=False, ZERO_CENTERED=zc, BLOCK_N=4096, RSTD_IN=True, ROUND_NORMED=rn)
    sig = {}
    for p in K._norm_fwd_kernel.params:
        n = p.name
        if p.is_constexpr:
            sig[n] = "constexpr"
            const.setdefault(n, p.default)
        elif n in ("x_ptr", "w_ptr", "b_ptr", "y_ptr"):
            sig[n] = "*" + dtype
        elif n.endswith("_ptr"):
            sig[n] = "*fp32" if n in ("mean_ptr", "rstd_ptr") else "constexpr"
            if sig[n] == "constexpr":
                const[n] = None
        else:
            sig[n] = "fp32" if n == "eps" else "i32"
    names = list(sig)
    src = ASTSource(K._norm_fwd_kernel, sig, {(names.index(k),): v for k, v in const.items()})
    out[f"hf {dtype} {zc} {rn}"] = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def ptx() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton's default today, said (3.9 warns while it is unset)
    run = subprocess.run(
        [sys.executable, "-c", _COMPILE, json.dumps(_INTS), json.dumps(_CASES)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    if run.returncode:  # a Triton without the NVIDIA backend's compiler here
        pytest.skip(f"Triton cannot compile for sm_90 on this machine: {run.stderr.strip().splitlines()[-1:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("dtype", "backward"), _CASES, ids=[f"{d}-{'bwd' if b else 'fwd'}" for d, b in _CASES])
def test_rope_rounds_every_product_on_its_own(ptx, dtype, backward):
    ptx = ptx[f"{dtype} {backward}"]
    fmas = re.findall(r"^\s*fma\.\S+", ptx, flags=re.M)
    assert not fmas, f"{dtype} {'backward' if backward else 'forward'}: products contracted into {sorted(set(fmas))}"
    muls = re.findall(r"^\s*mul\.\S*f32", ptx, flags=re.M)
    assert len(muls) == 8 and all(".ftz" not in m for m in muls), muls  # 4 products x 2 rows of the unrolled tile


_HF = [(d, z, r) for d in ("bf16", "fp32") for z in (False, True) for r in (False, True)]


@pytest.mark.parametrize(
    ("dtype", "zc", "rn"), _HF, ids=[f"{d}-{'gemma' if z else 'llama'}-{'round' if r else 'no-round'}" for d, z, r in _HF]
)
def test_stock_statistics_applied_without_an_fma(ptx, dtype, zc, rn):
    """``rms_norm_hf``'s kernel applying torch's statistics (``RSTD_IN``): ``x * rstd`` (rounded to
    x's dtype for Llama) times the weight (``1 + weight`` for Gemma): multiplies only, each rounded."""
    fmas = re.findall(r"^\s*fma\.\S+", ptx[f"hf {dtype} {zc} {rn}"], flags=re.M)
    assert not fmas, sorted(set(fmas))
