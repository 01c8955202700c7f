#!/usr/bin/env bash
# The GPU runs issues 47 and 48 wait for, each part one device call (under 10 minutes on one H100):
#   bash experiments/gpu_next.sh graphs    # 47: the demo's step graphed and eager, fast and batch-invariant
#                                          #     with issue 48's fusions, against stock; which kernels a replay runs longer
#   bash experiments/gpu_next.sh kernels   # the CUDA tests of what changed without a GPU, verify on cuda
#   bash experiments/gpu_next.sh attention # the attention tile sweep (full_blocks, state_in_memory, 128-key candidates)
#   bash experiments/gpu_next.sh defaults  # 48: each opt-in fusion alone against truefuse, round-robin
#   bash experiments/gpu_next.sh profile   # 48: the step's kernel time by kind, each fusion alone and together,
#                                          #     fast and batch-invariant, stock compiled
# Results under $OUT (the device tool's folder; ./gpu_next_out elsewhere), a short table printed last.
# Runs with the machine's python3 (torch, triton, transformers there) on this checkout.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_next_out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY="${PYTHON:-python3}"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  git rev-parse --short HEAD 2>/dev/null || cat COMMIT 2>/dev/null
} > "$OUT/gpu.txt" 2>&1

case "${1:-}" in
graphs)
  # three variants fit one H100 with --share-pool (four ran out of memory); the deadline keeps the call inside 10 minutes
  timeout 420 $PY experiments/exp_graphs.py "$OUT" --config demo --parts train --share-pool --train-rounds 5 \
    --variants "stock,truefuse fused,truefuse BI fused" --deadline-s 330 > "$OUT/graphs.log" 2>&1
  echo "exp_graphs rc $?"
  timeout 150 $PY experiments/exp_graph_kernels.py "truefuse BI fused,truefuse fused" --config demo > "$OUT/graph_kernels.txt" 2>&1
  echo "exp_graph_kernels rc $?"
  tail -n 25 "$OUT/graphs.log"; tail -n 30 "$OUT/graph_kernels.txt"
  ;;
kernels)
  timeout 300 $PY -m pytest -q -n 8 -p no:cacheprovider tests/test_attention.py tests/test_sibling_linears.py \
    tests/hf/test_sibling_grads.py tests/hf/test_cuda_graphs.py tests/test_add_norm.py tests/hf/test_residual_norm.py \
    tests/test_kept_launches.py tests/test_gated_activation.py tests/test_gemm_tma.py tests/test_batch_invariant.py \
    > "$OUT/pytest.log" 2>&1
  echo "pytest rc $?"
  timeout 200 $PY -m truefuse verify --device cuda --op sibling_linears --op attention --op gemm --op gated_activation --quiet > "$OUT/verify.log" 2>&1
  echo "verify rc $?"
  grep -E "FAILED|ERROR" "$OUT/pytest.log" | head -20; tail -n 1 "$OUT/pytest.log"; grep -E "FAIL" "$OUT/verify.log" | head; tail -n 2 "$OUT/verify.log"
  ;;
attention)
  # each candidate's bits (two backward runs, verify's bitwise cases) and time against SDPA's faster backend
  timeout 560 $PY experiments/exp_attention_configs.py "$OUT" 420 > "$OUT/attention_configs.log" 2>&1
  echo "exp_attention_configs rc $?"
  tail -n 30 "$OUT/attention_configs.log"
  ;;
defaults)
  # 48: each opt-in fusion alone against truefuse, round-robin, eager and graphed (whether to make them the default)
  timeout 560 $PY experiments/exp_graphs.py "$OUT" --config demo --parts train --share-pool --train-rounds 6 \
    --variants "truefuse,truefuse siblings,truefuse resnorm" --deadline-s 450 > "$OUT/graphs_defaults.log" 2>&1
  echo "exp_graphs rc $?"
  tail -n 25 "$OUT/graphs_defaults.log"
  ;;
profile)
  # two invocations, each with its own limit: a run cut by the limit takes only its half's table with it
  timeout 270 $PY experiments/exp_hf_profile.py --fused --top 8 --runs \
    "truefuse,truefuse+siblings,truefuse+resnorm,truefuse+resnorm+siblings+adamw" > "$OUT/hf_profile_fast.txt" 2>&1
  echo "exp_hf_profile (fast) rc $?"
  timeout 290 $PY experiments/exp_hf_profile.py --fused --top 8 --runs \
    "truefuse+bi,truefuse+bi+resnorm+siblings+adamw,stock+compile" > "$OUT/hf_profile_bi.txt" 2>&1
  echo "exp_hf_profile (bi, stock compiled) rc $?"
  grep -h -A 16 "^ms / step" "$OUT/hf_profile_fast.txt" "$OUT/hf_profile_bi.txt"
  ;;
*)
  echo "usage: bash experiments/gpu_next.sh graphs|kernels|attention|defaults|profile" >&2
  exit 2
  ;;
esac
