"""One rank's share of the 2-way vocab-parallel loss on ONE GPU: its compute and memory, no
communication (a 1-process NCCL group holding half the LM head), beside the one-GPU loss on the
whole head in the same run. A lower bound for ``bench tp --world-size 2`` where no 2-GPU machine
is lent. ``PYTHONPATH=. python experiments/exp_vocab_parallel_rank.py [out_dir]``."""

import sys

from truefuse.bench.bench_tp_linear_cross_entropy import run

if __name__ == "__main__":
    sys.exit(run(1, sys.argv[1] if len(sys.argv) > 1 else "bench_results", shards=2))
