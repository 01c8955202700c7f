"""Which part of a patch makes a Hugging Face model's loss curve leave stock's? The demo's
training (``truefuse.demo``) with five runs from the same weights on the same batches:

* ``stock``, and ``stock_again`` (an identity patch: the run-to-run noise of the same code, the
  yardstick of "same-precision noise");
* ``truefuse``: ``apply_truefuse`` (norms with the stock rounding: bitwise; MLP activation and
  loss bounded);
* ``truefuse_norm_once``: the same, but every norm on ``truefuse.rms_norm``'s own rule (fp32
  statistics reduced in truefuse's order, one rounding): what a hand patch with ``truefuse.RMSNorm`` does;
* ``liger`` (when liger_kernel is importable): its Llama patch, last (it patches process-wide state).

Run: ``PYTHONPATH=. python experiments/exp_hf_norm_rounding.py [steps] [out_dir]`` on one GPU.
"""

from __future__ import annotations

import sys

import torch

from truefuse.demo.cli import liger_patch
from truefuse.demo.report import print_table, summarize, write
from truefuse.demo.train import make_config, run_demo
from truefuse.integrations.huggingface import apply_truefuse


def _norm_once(model):
    return str(apply_truefuse(model, stock_norm_bits=False))


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 50
    out = sys.argv[2] if len(sys.argv) > 2 else "exp_hf_norm_rounding_out"
    cfg = make_config("gpu" if torch.cuda.is_available() else "cpu", steps=steps)
    peers = {"stock_again": lambda m: "identity", "truefuse": apply_truefuse, "truefuse_norm_once": _norm_once}
    try:
        peers["liger"] = liger_patch()
    except ImportError:
        pass
    result = run_demo(cfg, peers, log=lambda s: print(s, file=sys.stderr), quiet=True)
    rows = summarize(result)
    print_table(result, rows)
    write(result, rows, out)
    stock = result.runs[0].losses
    print("max |loss - stock| per step block of 10:")
    for run in result.runs[1:]:
        d = [abs(a - b) for a, b in zip(run.losses, stock, strict=True)]
        print(f"  {run.name:<20}", " ".join(f"{max(d[i : i + 10]):.4f}" for i in range(0, len(d), 10)))


if __name__ == "__main__":
    main()
