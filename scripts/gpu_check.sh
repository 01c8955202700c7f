#!/usr/bin/env bash
# GPU checks in one call: the test suite on the GPU, verify on cuda, the benchmarks, and on a
# machine of several GPUs the allreduce and parallel layers' tables, the allreduce's latency and
# the parallel MLP's time (WORLDS="2 4" by default; "" skips).
# Runs with the machine's own python3 (torch + triton preinstalled, no network): truefuse from
# this checkout through PYTHONPATH. Logs and results go under $OUT; a short table is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_results}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# docs/design.md §4 / the device README: never NVLink multicast
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY="${PYTHON:-python3}"
# peers for the cross-entropy benchmark, carried as wheels in .whl/ (no network on the GPU machine)
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
BENCHES="${BENCHES-gemm linear rms_norm grouped linear_cross_entropy linear_log_probs adamw sibling_linears}"  # BENCHES="" runs none

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"

tests_rc=skipped
if [ "${TESTS:-1}" = 1 ]; then  # TESTS=0: benchmarks only
  # -v: each result is in the log as it happens (a run cut at a time limit still names its failures)
  $PY -m pytest -n "${JOBS:-8}" -v --tb=short --durations=25 -p no:cacheprovider -m "" tests > "$OUT/pytest.log" 2>&1
  tests_rc=$?
  grep -E "^\[gw[0-9]+\] .*(FAILED|ERROR)|^(FAILED|ERROR) " "$OUT/pytest.log" | head -n 40
  tail -n 1 "$OUT/pytest.log"
fi
$PY -m truefuse verify --device cuda --quiet > "$OUT/verify.log" 2>&1
verify_rc=$?
$PY -m truefuse info > "$OUT/info.log" 2>&1
for b in $BENCHES; do
  $PY -m truefuse bench "$b" --out "$OUT" > "$OUT/bench_$b.log" 2>&1 || echo "bench $b failed (see bench_$b.log)"
done
# several GPUs: the allreduce's bitwise table and latency at each world size up to the GPU count
gpus=$($PY -c "import torch; print(torch.cuda.device_count())")
WORLDS="${WORLDS-2 4}"
for w in $WORLDS; do
  [ "$w" -le "$gpus" ] || continue
  $PY -m truefuse verify --world-size "$w" --device cuda > "$OUT/verify_w$w.log" 2>&1; echo "verify --world-size $w rc=$?"
  tail -n 1 "$OUT/verify_w$w.log"
  $PY -m truefuse bench allreduce_add_rmsnorm --world-size "$w" --out "$OUT" > "$OUT/bench_allreduce_w$w.log" 2>&1
  grep -v -i warn "$OUT/bench_allreduce_w$w.log" | tail -n 29
  $PY -m truefuse bench tp --world-size "$w" --out "$OUT" > "$OUT/bench_tp_w$w.log" 2>&1
  grep -v -i warn "$OUT/bench_tp_w$w.log" | tail -n 12
done

echo "== verify (failures) =="; grep -E "FAIL" "$OUT/verify.log" | head -20; tail -n 1 "$OUT/verify.log"
for b in $BENCHES; do echo "== bench $b =="; cat "$OUT/bench_$b.log"; done
echo "tests rc=$tests_rc verify rc=$verify_rc"
