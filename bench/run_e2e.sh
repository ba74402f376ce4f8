#!/usr/bin/env bash
# The whole training loop on one GPU node: a random Qwen3-0.6B-shaped model, the built-in
# multi-turn environments (configs/multiturn.yaml), STEPS steps of BATCH prompts x N
# samples, in each MODE:
#   disagg-sync   configs/gpu-disagg.toml: trainer GPU 0, native engine GPU 1
#   disagg-async  the same with --max-weight-staleness 1 --partial-rollout
#   colocated     configs/gpu-colocated.toml: trainer and engine share GPU 0
#   colocated-on-policy  the same with --true-on-policy-mode (one attention kernel both sides)
# Writes under $OUT: runs/MODE/ (metrics.jsonl, trained_ids.jsonl, TensorBoard events),
# MODE/traces.jsonl (every span, through bin/otlp_sink), MODE/progress.txt (the step
# lines), MODE/driver.log, e2e_MODE.json (step_s = rollout_s + train_s + sync_s + other_s)
# and report.md; prints the table last.
#
# Here (no GPU needed):  bench/run_e2e.sh build      # release driver + otlp_sink into bin/
# There (device tool, carry ["bin"]):  bench/run_e2e.sh disagg-sync disagg-async colocated
# STEPS / BATCH / N_SAMPLES / MAX_RESPONSE_LEN override the acceptance shape (20 / 32 / 8 / 64).
set -euo pipefail
if [ "${1:-}" = build ]; then
  cargo build --release -p manta-driver --bin driver -p manta-bench --bin otlp_sink
  mkdir -p bin && cp target/release/driver target/release/otlp_sink bin/
  strip bin/driver bin/otlp_sink   # the device tool carries 64 MiB at most
  ls -la bin/driver bin/otlp_sink
  exit 0
fi
TL=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib
export LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${STEPS:-20}; BATCH=${BATCH:-32}; N=${N_SAMPLES:-8}; LEN=${MAX_RESPONSE_LEN:-64}
MODES=("$@"); [ ${#MODES[@]} -gt 0 ] || MODES=(disagg-sync disagg-async colocated)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
MODEL=/tmp/manta-e2e/qwen3-0.6b
python3 bench/py/e2e_model.py assets/tiny-qwen3 "$MODEL"
port=4317
for mode in "${MODES[@]}"; do
  case $mode in
    disagg-sync)  cluster=configs/gpu-disagg.toml; extra=() ;;
    disagg-async) cluster=configs/gpu-disagg.toml; extra=(--max-weight-staleness 1 --partial-rollout) ;;
    colocated)    cluster=configs/gpu-colocated.toml; extra=() ;;
    colocated-on-policy) cluster=configs/gpu-colocated.toml; extra=(--true-on-policy-mode) ;;
    *) echo "unknown mode $mode (disagg-sync, disagg-async, colocated, colocated-on-policy)" >&2; exit 2 ;;
  esac
  mkdir -p "$OUT/$mode"
  port=$((port + 1))
  ./bin/otlp_sink "127.0.0.1:$port" "$OUT/$mode/traces.jsonl" 2>"$OUT/$mode/otlp_sink.log" &
  sink=$!
  echo "== $mode ($cluster ${extra[*]:-})"
  status=0
  OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:$port" RUST_LOG=${RUST_LOG:-info} \
    ./bin/driver --cluster "$cluster" --model "$MODEL" --runs-dir "$OUT/runs" \
      --run-name "$mode" --num-rollout "$STEPS" --rollout-batch-size "$BATCH" \
      --n-samples "$N" --max-response-len "$LEN" "${extra[@]}" \
      2>"$OUT/$mode/driver.log" | tee "$OUT/$mode/progress.txt" || status=$?
  sleep 2   # the last spans' export
  kill "$sink" 2>/dev/null || true
  wait "$sink" 2>/dev/null || true
  if [ "$status" -ne 0 ]; then
    echo "$mode failed (exit $status); last lines of its log:" >&2
    tail -n 30 "$OUT/$mode/driver.log" >&2
  fi
  echo "$mode: $(wc -l < "$OUT/$mode/traces.jsonl") spans"
done
python3 bench/py/e2e_report.py "$OUT" "${MODES[@]}"
