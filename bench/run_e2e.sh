#!/usr/bin/env bash
# The whole training loop on one GPU node: a random Qwen3-0.6B-shaped model, the built-in
# multi-turn environments (configs/multiturn.yaml), STEPS steps of BATCH prompts x N
# samples, in each MODE:
#   disagg-sync   configs/gpu-disagg.toml: trainer GPU 0, native engine GPU 1
#   disagg-async  the same with --max-weight-staleness 1 --partial-rollout
#   colocated     configs/gpu-colocated.toml: trainer and engine share GPU 0
#   colocated-on-policy  the same with --true-on-policy-mode (one attention kernel both sides)
#   dp2-colocated configs/gpu-dp2-colocated.toml: trainer ranks on GPUs 0 and 1 (ZeRO-2
#                 over NCCL), a native engine colocated on each
#   dp2-disagg, dp2-disagg-async  configs/gpu4-dp2-disagg.toml (four GPUs): trainer ranks on
#                 GPUs 0 and 1, native engines on GPUs 2 and 3; synchronous and asynchronous
#   dp2-disagg-1engine  the same with one engine (GPU 2) taking the whole step's episodes
#   rollout-2engines, rollout-1engine  the four-GPU layout with --debug-rollout-only (no
#                 training): 256 episodes in flight per engine, two engines or one; with
#                 more episodes than one engine holds, the rate two engines add
#   sglang-disagg configs/gpu-sglang-disagg.toml: trainer GPU 0, an SGLang server on GPU 1
#                 fed over NCCL; needs SGLang importable by python3 (bench/sglang/);
#                 SGLANG_LOG_LEVEL=debug adds `--log-level debug` to the server's arguments,
#                 SGLANG_EXTRA="--mem-fraction-static 0.4" any other flags
#   sglang-colocated configs/gpu-sglang-colocated.toml: trainer and an SGLang server share
#                 GPU 0, weights through a safetensors file each step
#                 For both SGLang modes: SGLANG_KILL_AT_STEP=K sends SIGKILL to the server
#                 1 s after step K is reported (the run must go on, no episode lost);
#                 a run whose server logs SGLang's "Health check failed" (a stalled
#                 scheduler), or that reports no step for HANG_S seconds (default 120), gets a
#                 py-spy dump of every SGLang process in MODE/pyspy.txt (py-spy comes
#                 with the bundle) and the server log's tail in MODE/engine_tail.log
#   ors-sdk       disagg-sync against bench/py/ors_load_env.py, a counter environment
#                 served by the real `openreward` SDK (configs/sdk-counter.yaml); the
#                 SDK must be importable by python3 (docs/gpu.md, "The whole loop on a GPU node")
#   learn-colocated, learn-disagg-sync, learn-disagg-async: the job of `make run` (tiny
#                 model assets/tiny-qwen3, digits environment, 120 steps of 8 x 8) in
#                 each placement, to show the reward rising on GPUs
# Writes under $OUT: runs/MODE/ (metrics.jsonl, trained_ids.jsonl, TensorBoard events),
# MODE/traces.jsonl (every span, through bin/otlp_sink), MODE/progress.txt (the step
# lines), MODE/driver.log, e2e_MODE.json (step_s = rollout_s + train_s + sync_s + other_s)
# and report.md; prints the table last.
#
# Here (no GPU needed):  bench/run_e2e.sh build      # release driver + otlp_sink into bin/
# There (device tool, carry ["bin"]):  bench/run_e2e.sh disagg-sync disagg-async colocated
# STEPS / BATCH / N_SAMPLES / MAX_RESPONSE_LEN override the acceptance shape (20 / 32 / 8 / 64);
# MODEL_SHAPE=8b gives the random model Qwen3-8B's shape instead of Qwen3-0.6B's.
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
MODEL_SHAPE=${MODEL_SHAPE:-0.6b}
E2E_MODEL=/tmp/manta-e2e/qwen3-$MODEL_SHAPE
python3 bench/py/e2e_model.py assets/tiny-qwen3 "$E2E_MODEL" "$MODEL_SHAPE"
# The tiny job of `make run`: its model, environments and shape, on GPUs.
TINY=(--config train_config.yaml --lr 0.003 --rollout-batch-size 8 --n-samples 8
      --max-response-len 8 --max-tokens-per-gpu 8192)
ASYNC=(--max-weight-staleness 1 --partial-rollout)
port=4317
# Beside an SGLang run: kills the server after step SGLANG_KILL_AT_STEP, and dumps every
# SGLang process's Python stacks once when no step is reported for HANG_S seconds.
sglang_watch() {
  local mode=$1 progress=$OUT/$1/progress.txt pidfile=$OUT/runs/$1/engines/0.pid
  local killed= dumped= last=0 quiet_since=$SECONDS
  while sleep 2; do
    local steps; steps=$(grep -c '^step ' "$progress" 2>/dev/null || true)
    if [ "${steps:-0}" != "$last" ]; then last=$steps; quiet_since=$SECONDS; fi
    if [ -n "${SGLANG_KILL_AT_STEP:-}" ] && [ -z "$killed" ] && [ "${steps:-0}" -ge "$SGLANG_KILL_AT_STEP" ] && [ -f "$pidfile" ]; then
      sleep 1; killed=$(cat "$pidfile")
      echo "[watch] step $steps: kill -9 $killed (the SGLang server)" | tee -a "$OUT/$mode/watch.log"
      kill -9 "$killed" || true
    fi
    # SGLang's own health check reports a stalled scheduler ~20 s in, before Manta's
    # /health probes restart the server: dump then, while the stalled process lives.
    local stalled=
    grep -q "Health check failed" "$OUT/runs/$mode/engines/0.log" 2>/dev/null && stalled=1
    if [ -z "$dumped" ] && { [ -n "$stalled" ] || { [ "${steps:-0}" -ge 1 ] && [ $((SECONDS - quiet_since)) -ge "${HANG_S:-120}" ]; }; }; then
      dumped=1
      echo "[watch] ${stalled:+SGLang reports a stalled scheduler; }no step for $((SECONDS - quiet_since)) s after step $steps: dumping stacks" | tee -a "$OUT/$mode/watch.log"
      # The bundle unpacks wheels as they are: py-spy's binary sits in its .data folder.
      local pyspy; pyspy=$(command -v py-spy || find /tmp/site -name py-spy -type f 2>/dev/null | head -n 1)
      chmod +x "$pyspy" 2>/dev/null || true
      for p in $(pgrep -f 'sglang::|sglang.launch_server|bin/driver' || true); do
        echo "=== pid $p: $(tr '\0' ' ' </proc/$p/cmdline 2>/dev/null | cut -c1-160)"
        timeout 30 "$pyspy" dump --pid "$p" 2>&1 || true
      done >"$OUT/$mode/pyspy.txt" 2>&1
      tail -n 200 "$OUT/runs/$mode/engines/0.log" >"$OUT/$mode/engine_tail.log" 2>/dev/null || true
    fi
  done
}
for mode in "${MODES[@]}"; do
  MODEL=$E2E_MODEL; steps=$STEPS; shape=(--rollout-batch-size "$BATCH" --n-samples "$N" --max-response-len "$LEN")
  case $mode in
    disagg-sync)  cluster=configs/gpu-disagg.toml; extra=() ;;
    disagg-async) cluster=configs/gpu-disagg.toml; extra=("${ASYNC[@]}") ;;
    colocated)    cluster=configs/gpu-colocated.toml; extra=() ;;
    colocated-on-policy) cluster=configs/gpu-colocated.toml; extra=(--true-on-policy-mode) ;;
    dp2-colocated) cluster=configs/gpu-dp2-colocated.toml; extra=() ;;
    dp2-disagg)   cluster=configs/gpu4-dp2-disagg.toml; extra=() ;;
    dp2-disagg-async) cluster=configs/gpu4-dp2-disagg.toml; extra=("${ASYNC[@]}") ;;
    rollout-2engines|rollout-1engine)
                  cluster=configs/.gpu4-$mode.toml; extra=(--debug-rollout-only)
                  n=2; [ "$mode" = rollout-1engine ] && n=1
                  sed -e "s/^engines = 2/engines = $n/" -e 's/^max_concurrent_episodes = 128 /max_concurrent_episodes = 256 /' \
                      -e 's/^max_batch_size = 128/max_batch_size = 256/' configs/gpu4-dp2-disagg.toml > "$cluster"
                  grep -q "^engines = $n" "$cluster" || { echo "configs/gpu4-dp2-disagg.toml: no 'engines = 2' line to change" >&2; exit 2; } ;;
    dp2-disagg-1engine)
                  # A copy beside the original (train_config is relative to it): one engine
                  # with the concurrency the two had together.
                  cluster=configs/.gpu4-dp2-disagg-1engine.toml; extra=()
                  sed -e 's/^engines = 2/engines = 1/' -e 's/^max_concurrent_episodes = 128 /max_concurrent_episodes = 256 /' \
                      -e 's/^max_batch_size = 128/max_batch_size = 256/' configs/gpu4-dp2-disagg.toml > "$cluster"
                  grep -q '^engines = 1' "$cluster" || { echo "configs/gpu4-dp2-disagg.toml: no 'engines = 2' line to change" >&2; exit 2; } ;;
    sglang-disagg|sglang-colocated) cluster=configs/gpu-$mode.toml; extra=()
                  words=${SGLANG_LOG_LEVEL:+--log-level $SGLANG_LOG_LEVEL}${SGLANG_EXTRA:+ $SGLANG_EXTRA}
                  if [ -n "$words" ]; then
                    # A copy of the config beside the original (train_config is relative to it).
                    debug_cluster=configs/.gpu-$mode.extra.toml
                    python3 - "$cluster" "$debug_cluster" "$words" <<'PY'
import json, re, sys
src, dst, words = sys.argv[1:]
text = open(src).read()
more = ", ".join(json.dumps(w) for w in words.split())
text, n = re.subn(r'^extra_args = \[(.*?)\]', lambda m: f'extra_args = [{m.group(1)}, {more}]', text, count=1, flags=re.M)
assert n == 1, f"{src}: no extra_args line to extend"
open(dst, "w").write(text)
PY
                    cluster=$debug_cluster
                  fi ;;
    ors-sdk)      cluster=configs/gpu-disagg.toml; extra=(--config configs/sdk-counter.yaml)
                  steps=${SDK_STEPS:-5} ;;
    learn-colocated|learn-disagg-sync|learn-disagg-async)
                  MODEL=assets/tiny-qwen3; steps=${LEARN_STEPS:-120}; shape=()
                  cluster=configs/gpu-disagg.toml; [ "$mode" = learn-colocated ] && cluster=configs/gpu-colocated.toml
                  extra=("${TINY[@]}"); [ "$mode" = learn-disagg-async ] && extra+=("${ASYNC[@]}") ;;
    *) echo "unknown mode $mode (disagg-sync, disagg-async, colocated, colocated-on-policy, dp2-colocated, dp2-disagg, dp2-disagg-async, dp2-disagg-1engine, rollout-2engines, rollout-1engine, sglang-disagg, sglang-colocated, ors-sdk, learn-colocated, learn-disagg-sync, learn-disagg-async)" >&2; exit 2 ;;
  esac
  env_server=
  if [ "$mode" = ors-sdk ]; then
    OPENREWARD_DISABLE_UPDATE_CHECK=1 python3 bench/py/ors_load_env.py 127.0.0.1 8765 >"$OUT/ors_sdk_server.log" 2>&1 &
    env_server=$!
    for _ in $(seq 1 100); do curl -sf http://127.0.0.1:8765/health >/dev/null && break; sleep 0.2; done
  fi
  mkdir -p "$OUT/$mode"
  port=$((port + 1))
  ./bin/otlp_sink "127.0.0.1:$port" "$OUT/$mode/traces.jsonl" 2>"$OUT/$mode/otlp_sink.log" &
  sink=$!
  echo "== $mode ($cluster ${extra[*]:-})"
  watcher=
  case $mode in sglang-*)
    : >"$OUT/$mode/progress.txt"
    sglang_watch "$mode" & watcher=$! ;;
  esac
  status=0
  OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:$port" RUST_LOG=${RUST_LOG:-info} \
    ./bin/driver --cluster "$cluster" --model "$MODEL" --runs-dir "$OUT/runs" \
      --run-name "$mode" --num-rollout "$steps" "${shape[@]}" "${extra[@]}" \
      2>"$OUT/$mode/driver.log" | tee "$OUT/$mode/progress.txt" || status=$?
  [ -z "$watcher" ] || { kill "$watcher" 2>/dev/null; wait "$watcher" 2>/dev/null || true; }
  sleep 2   # the last spans' export
  kill "$sink" $env_server 2>/dev/null || true
  wait "$sink" $env_server 2>/dev/null || true
  if [ "$status" -ne 0 ]; then
    echo "$mode failed (exit $status); last lines of its log:" >&2
    tail -n 30 "$OUT/$mode/driver.log" >&2
  fi
  echo "$mode: $(wc -l < "$OUT/$mode/traces.jsonl") spans"
done
python3 bench/py/e2e_report.py "$OUT" "${MODES[@]}"
