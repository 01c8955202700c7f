"""What does the GPU compiler make of the attention kernels' tiles, without a GPU? Each candidate of
``exp_attention_configs.py`` (and the launch table's own) compiled by Triton for sm_90a on the CPU
and assembled by the ptxas Triton ships: registers a thread, spill bytes, shared memory. A screen
before GPU time (docs/benchmarks.md, "Attention"): a tile that spills in its main loop, or a
variant that adds spills, is suspect before it is timed.

The compile is specialized as a launch of the timed shapes is (B=4, 32/8 heads, L=2048/4096, head
dim 128, bf16): pointers 16-byte aligned and every int divisible by 16 but ``GROUP``. Without that
(a plain ``i32`` signature) the loads do not vectorize and the forward showed 448 spill bytes that
a real launch does not have.

Run from the repository root, no GPU needed: ``PYTHONPATH=. python experiments/exp_kernel_registers.py``
(Triton's version decides; the GPU machine's is in docs/benchmarks.md's tables)."""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compile, not interpret (before any kernel module imports)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from exp_attention_configs import BASE, BWD, FWD  # noqa: E402

import truefuse.kernels.attention as ka  # noqa: E402

_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
_PTRS = {"KeyStart": "*i32", "Lse": "*fp32", "Part": "*fp32", "Delta": "*fp32"}  # the others' bf16
_PTR_NAMES = {"Q", "K", "V", "Mask", "Out", "DO", "DQ", "DK", "DV", *_PTRS}
_FLAGS = dict(BLOCK_D=128, CAUSAL=True, HAS_WINDOW=False, SOFTCAP=False, MASK_KIND=0, PRECISION="tf32", INTERPRETED=False)


def compiled(kernel, const: dict, warps: int, stages: int) -> tuple:
    """(registers, spill store bytes, spill load bytes, shared bytes) of ``kernel`` for sm_90a."""
    names = list(inspect.signature(kernel.fn).parameters)
    const = {k: v for k, v in const.items() if k in names}
    sig = {}
    for n in names:
        if n in const:
            sig[n] = "constexpr"
        elif n in _PTR_NAMES:
            sig[n] = _PTRS.get(n, "*bf16")
        else:
            sig[n] = "fp32" if n in ("scale", "softcap") else "i32"
    aligned = [i for i, n in enumerate(names) if sig[n][0] == "*" or (sig[n] == "i32" and n != "GROUP")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    src = ASTSource(kernel, sig, {(names.index(k),): v for k, v in const.items()}, attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 128), options=dict(num_warps=warps, num_stages=stages))
    with tempfile.TemporaryDirectory() as d:
        ptx = os.path.join(d, "k.ptx")
        with open(ptx, "w") as f:
            f.write(k.asm["ptx"])
        for ptxas in ("ptxas", "ptxas-blackwell"):  # the second where the first is older than Triton's PTX
            cmd = [os.path.join(_BIN, ptxas), "-arch=sm_90a", "-v", ptx, "-o", ptx + ".cubin"]
            run = subprocess.run(cmd, capture_output=True, text=True)
            if run.returncode == 0:
                break
        else:
            raise RuntimeError(run.stderr[-300:])
    num = [re.search(p, run.stderr) for p in (r"Used (\d+) registers", r"(\d+) bytes spill stores", r"(\d+) bytes spill loads")]
    return (*(int(m.group(1)) if m else 0 for m in num), k.metadata.shared)


def rows():
    """(pass, candidate, stats) for the forward candidates, then the backward's (dK/dV, dQ)."""
    for m, warps, stages, block_n, *switches in FWD:
        full, in_memory = (*map(bool, switches), False, False)[:2]
        tiles = dict(BLOCK_M=m, BLOCK_N=block_n, CHUNK=BASE.chunk)
        const = dict(_FLAGS, **tiles, SPLIT=False, FULL_BLOCKS=full, STATE_IN_MEMORY=in_memory)
        yield "fwd", (m, warps, stages, block_n, full, in_memory), compiled(ka._attention_fwd_kernel, const, warps, stages)
    seen = set()
    for (m, n, warps, stages), dq in BWD:
        full = bool(dq[4]) if len(dq) > 4 else False
        if (m, n, warps, stages, full) not in seen:
            seen.add((m, n, warps, stages, full))
            const = dict(_FLAGS, BLOCK_M=m, BLOCK_N=n, FULL_BLOCKS=full)
            yield "dkdv", (m, n, warps, stages, full), compiled(ka._attention_bwd_dkdv_kernel, const, warps, stages)
        if tuple(dq) not in seen:
            seen.add(tuple(dq))
            const = dict(_FLAGS, BLOCK_M=dq[0], BLOCK_N=dq[1], FULL_BLOCKS=full)
            yield "dq", tuple(dq), compiled(ka._attention_bwd_dq_kernel, const, dq[2], dq[3])


def main() -> None:
    table = dataclasses.astuple(BASE)
    print(f"triton {triton.__version__}, sm_90a; the launch table (bf16, head dim 128): {table}")
    print(f"{'pass':5} {'candidate':28} {'regs':>5} {'spill st':>9} {'spill ld':>9} {'shared':>8}")
    for name, cand, (regs, st, ld, smem) in rows():
        print(f"{name:5} {str(cand):28} {regs:5} {st:9} {ld:9} {smem:8}")


if __name__ == "__main__":
    main()
