"""Do the norm kernels of two trees compile to the same code (issue 46: the ops/ move and the
HAS_RES / HAS_DRES flags of issue 48.1 were to change no kernel)? No GPU needed: Triton compiles
for sm_90 on the CPU.

    TRITON_DEFAULT_FP_FUSION=1 python experiments/exp_ptx_trees.py OLD_TREE > before.json
    TRITON_DEFAULT_FP_FUSION=1 python experiments/exp_ptx_trees.py . > after.json
    python experiments/exp_ptx_trees.py --compare before.json after.json

Each line of a tree's JSON: a config of ``_norm_fwd_kernel`` (RMSNorm, bf16, BLOCK_N 4096, every
combination of RSTD_IN / HF_STATS / ROUND_NORMED / PERSISTENT / PDL) or ``_norm_bwd_kernel``
(PREFETCH, ROWS, PDL), and the hash and length of its PTX body (parameter declarations and loads,
labels and comments dropped: a new unused parameter changes no instruction).
"""

import hashlib
import itertools
import json
import sys

if sys.argv[1] == "--compare":
    b, a = (json.loads(open(f).read().strip().splitlines()[-1]) for f in sys.argv[2:4])
    for k in b:
        print(("SAME " if b[k] == a.get(k) else "DIFF ") + k, b[k], a.get(k))
    sys.exit(0)
sys.path.insert(0, sys.argv[1])
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import truefuse.kernels.norm as K  # noqa: E402

_DROP = ("//", ".param", ".visible", ".entry", ".file", ".loc", ".section", ".b8", ".b32", ".b64", "@", "$L__", ")", "(")


def body(ptx):
    """The instructions only: no parameter declarations or loads, labels, names or comments."""
    lines = [ln.strip() for ln in ptx.splitlines()]
    return [ln for ln in lines if ln and not ln.startswith(_DROP) and "ld.param" not in ln]


def compile_(kernel, sig, const, opts):
    names = list(sig)
    src = ASTSource(kernel, sig, {(names.index(k),): v for k, v in const.items()})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    return body(k.asm["ptx"])


fwd_params = [p.name for p in K._norm_fwd_kernel.params]
out = {}
for rstd_in, hf_stats, round_normed, persistent, pdl in itertools.product(
    [False, True], [False, True], [False, True], [False, True], [False, 1]
):
    if rstd_in and hf_stats:
        continue
    const = dict(
        IS_RMS=True,
        HAS_W=True,
        HAS_B=False,
        ZERO_CENTERED=False,
        BLOCK_N=4096,
        RSTD_IN=rstd_in,
        ROUND_NORMED=round_normed,
        PERSISTENT=persistent,
        EVICT="",
        PDL=pdl,
        WB="reg",
        HF_STATS=hf_stats,
    )
    sig = {}
    for p in fwd_params:
        if p in const:
            sig[p] = "constexpr"
        elif p.endswith("_ptr") and p not in ("r_ptr", "s_ptr"):
            sig[p] = "*bf16" if p in ("x_ptr", "w_ptr", "b_ptr", "y_ptr") else "*fp32"
        elif p in ("r_ptr", "s_ptr"):
            sig[p] = "constexpr"
            const[p] = None
        elif p == "eps":
            sig[p] = "fp32"
        elif p == "HAS_RES":
            sig[p] = "constexpr"
            const[p] = False
        else:
            sig[p] = "i32"
    lines = compile_(K._norm_fwd_kernel, sig, const, {"num_warps": 8})
    key = f"fwd rstd_in={rstd_in} hf_stats={hf_stats} round={round_normed} persistent={persistent} pdl={pdl}"
    out[key] = (hashlib.sha1("\n".join(lines).encode()).hexdigest()[:12], len(lines))
bwd_params = [p.name for p in K._norm_bwd_kernel.params]
for prefetch, rows, pdl in itertools.product([False, True], [1, 2], [False, 1]):
    const = dict(
        IS_RMS=True, HAS_W=True, HAS_B=False, ZERO_CENTERED=False, BLOCK_N=4096, ROWS=rows, PREFETCH=prefetch, EVICT="", PDL=pdl
    )
    sig = {}
    for p in bwd_params:
        if p in const:
            sig[p] = "constexpr"
        elif p == "dres_ptr":
            sig[p] = "constexpr"
            const[p] = None
        elif p == "HAS_DRES":
            sig[p] = "constexpr"
            const[p] = False
        elif p.endswith("_ptr"):
            sig[p] = "*bf16" if p in ("dy_ptr", "x_ptr", "w_ptr", "dx_ptr") else "*fp32"
        else:
            sig[p] = "i32"
    try:
        lines = compile_(K._norm_bwd_kernel, sig, const, {"num_warps": 8})
    except Exception as e:
        out[f"bwd prefetch={prefetch} rows={rows} pdl={pdl}"] = ("ERR " + str(e)[:80], 0)
        continue
    out[f"bwd prefetch={prefetch} rows={rows} pdl={pdl}"] = (hashlib.sha1("\n".join(lines).encode()).hexdigest()[:12], len(lines))
print(json.dumps(out))
