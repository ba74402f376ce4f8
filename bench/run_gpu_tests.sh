#!/usr/bin/env bash
# The GPU tests on the device machine, once per GPU: MANTA_TEST_GPU=i puts every CUDA test's
# engine, model, kernels and group on GPU i (the two-GPU tests put the trainer there and the
# server on the other GPU), while each test thread's current device stays GPU 0 — so code
# that assumes GPU 0 fails on GPU 1. A test that skipped says "skipped" in its log; the
# table counts those apart from the passes.
#
# Here (no GPU needed):  bench/run_gpu_tests.sh build   # release test binaries into bin/tests
# There (device tool, carry ["bin"]):  bench/run_gpu_tests.sh [GPU...]   # default: every GPU
# Needs bin/driver too (the serve tests launch `driver serve`): bench/run_e2e.sh build.
set -euo pipefail
if [ "${1:-}" = build ]; then
  mkdir -p bin/tests
  build() {  # cargo test --no-run ARGS..., copying each test executable to bin/tests
    cargo test --release --no-run --message-format=json "$@" | python3 bench/py/copy_test_executables.py bin/tests
  }
  build -p manta-cuda --lib --test nccl_group --test rope --test rms_norm --test swiglu
  build -p manta-model --test cuda --test segments --test fused_logprobs --test fused_decoder
  build -p manta-engine --test native_engine_cuda
  build -p manta-trainer --test collectives --test zero3_prefetch --test zero3_bf16
  build -p manta-driver --test serve_weights_nccl
  build -p manta-weight-sync --test sync_engines
  build -p manta-hosting --lib
  strip bin/tests/*
  ls -la bin/tests
  exit 0
fi
# A run on a machine without a GPU would only report skips: it is an error here.
COUNT=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
if [ "${COUNT:-0}" -eq 0 ]; then
  echo "error: no CUDA device visible (nvidia-smi -L lists none): GPU tests need the GPU machine" >&2
  exit 1
fi
GPUS=("$@"); [ ${#GPUS[@]} -gt 0 ] || GPUS=($(seq 0 $((COUNT - 1))))
for gpu in "${GPUS[@]}"; do
  [ "$gpu" -lt "$COUNT" ] || { echo "error: GPU $gpu asked for, this machine has $COUNT" >&2; exit 1; }
done
TL=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib
export LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-}
export MANTA_DRIVER_BIN=$PWD/bin/driver
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
status=0
printf '%-28s %4s %7s %7s %8s\n' binary gpu passed failed skipped | tee "$OUT/gpu_tests.txt"
for gpu in "${GPUS[@]}"; do
  for t in bin/tests/*; do
    name=$(basename "$t"); log="$OUT/test_${name}_gpu$gpu.log"
    # One test at a time: graph captures and the engine's memory share the GPU.
    MANTA_TEST_GPU=$gpu timeout "${TEST_TIMEOUT:-300}" "$t" --include-ignored --test-threads=1 --nocapture >"$log" 2>&1 || status=1
    passed=$(grep -oP 'test result: \w+\. \K[0-9]+(?= passed)' "$log" | tail -1)
    failed=$(grep -oP '[0-9]+(?= failed)' "$log" | tail -1)
    skipped=$(grep -c 'skipped: ' "$log" || true)
    printf '%-28s %4s %7s %7s %8s\n' "$name" "$gpu" "${passed:-?}" "${failed:-?}" "$skipped" | tee -a "$OUT/gpu_tests.txt"
  done
done
exit $status
