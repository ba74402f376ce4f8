#!/usr/bin/env bash
# Remote mode on one two-GPU host, STEPS steps of the multi-turn loop per MODE, every
# sync verified bit for bit (MANTA_VERIFY_WEIGHT_SYNC=1; VERIFY=0 times the sync without the read-back). Two layouts:
#   driver-rooted (configs/gpu2-worker-nccl.toml): the trainer in the driver on GPU 0,
#   one `worker` daemon hosting a native engine on GPU 1:
#     nccl           cluster.worker_weights = "nccl": one broadcast group rooted in the driver
#     grpc           the same layout with weights as gRPC chunks (the baseline)
#   trainer on a worker (configs/gpu2-workers-trainer-nccl.toml): worker A hosts the
#   trainer on GPU 0, worker B the engine on GPU 1, each worker in a directory of its own:
#     trainer-nccl   worker A roots the group and broadcasts its trainer's parameters
#     trainer-grpc   the same layout with weights as gRPC chunks (the baseline)
#     trainer-store  the CPU analogue (no GPU): the store backend, CPU trainer and engine,
#                    the tiny model unless MODEL_SHAPE is set, a small batch (DRIVER_ARGS)
#   data-parallel ranks on two workers (configs/gpu2-workers-trainer-dp2.toml): rank 0 on
#   worker A GPU 0, rank 1 on worker B GPU 1 (ZeRO-2 over NCCL, the id made by worker A
#   and carried by the driver), the engine on worker B beside rank 1:
#     trainer-dp2    STEPS steps of the loop (weights from rank 0's worker over NCCL), saving
#                    each step's rollouts; then DP2_STEPS (3) steps on those rollouts by the
#                    ranks on the workers and by local-mode ranks ([trainer] gpus = [0, 1],
#                    the same [train] keys), and compares the saved weights: worker A's
#                    rank 0 vs worker B's rank 1 vs local (compare.txt; fails unless all
#                    three are the same bits)
#     trainer-dp2-store  the CPU analogue (no GPU): CPU ranks through rank 0's store, a CPU
#                    engine fed by the store backend, local ranks as data_parallel_ranks = 2,
#                    the tiny model unless MODEL_SHAPE is set, a small batch (DRIVER_ARGS)
# Writes $OUT/workers_MODE/ (driver.log, worker*.log, progress.txt, sync_per_step.tsv:
# step, perf/update_weights_time, perf/pause_to_resume_time; runs/) and prints each
# mode's median sync time and step time.
#
# Here (no GPU needed):  bench/run_workers.sh build   # release driver + worker into bin/
#                        STEPS=4 bench/run_workers.sh trainer-store
#                        STEPS=3 bench/run_workers.sh trainer-dp2-store
#                        (BIN=$PWD/target/debug: the debug binaries instead of bin/)
# There (device tool, 2 GPUs, carry ["bin"]):  bench/run_workers.sh trainer-nccl trainer-grpc nccl grpc
#                        STEPS=20 bench/run_workers.sh trainer-dp2
# MODEL_SHAPE=8b gives the random model Qwen3-8B's shape.
# FAULT=engine@N or trainer@N (trainer-* modes): once step N is reported, SIGKILL worker B
# (the engine's) or worker A (the trainer's, which then restarts from its last checkpoint:
# add "--save DIR --save-interval 1" to DRIVER_ARGS, else from its initial weights);
# FAULT=engine-sync@N: SIGKILL worker B as soon as worker A starts the broadcast after
# step N (trainer-nccl: mid-broadcast for a large enough model; worker A's log says
# whether its collective failed); FAULT=trainer-sync@N kills worker A (the root) at that
# moment instead, leaving the engine mid-receive. FAULT=trainer-train@N / rank1-train@N: SIGKILL worker
# A / B FAULT_DELAY_S (0.5) seconds after its trainer starts training the step after N
# (mid-step). In the trainer-dp2 modes a fault sets on_failure = "restart" (the lost rank
# is re-created and the group resumes from each node's last checkpoint: add
# "--save DIR --save-interval 1" to DRIVER_ARGS) and skips the runs on saved rollouts. Either way the worker starts again FAULT_RESTART_S (3)
# seconds later in the same directory; writes fault.txt (when, what) and checks
# trained_ids.jsonl (every sample id trained exactly once).
set -euo pipefail
if [ "${1:-}" = build ]; then
  cargo build --release -p manta-driver --bin driver --bin worker
  mkdir -p bin && cp target/release/driver target/release/worker bin/ && strip bin/driver bin/worker
  exit 0
fi
TL=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib
export LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${STEPS:-20}
export MANTA_CLUSTER_TOKEN=${MANTA_CLUSTER_TOKEN:-bench-workers-token}
MODES=("$@"); [ ${#MODES[@]} -gt 0 ] || MODES=(nccl grpc)
ROOT=$PWD
BIN=${BIN:-$ROOT/bin}   # where driver and worker are (BIN=target/debug: a debug build)

# The random model of MODEL_SHAPE (default 0.6b; the CPU mode: the tiny model as is).
model_for() {
  local shape=${MODEL_SHAPE:-$1}
  if [ "$shape" = tiny ]; then echo "$ROOT/assets/tiny-qwen3"; return; fi
  python3 bench/py/e2e_model.py assets/tiny-qwen3 "/tmp/manta-e2e/qwen3-$shape" "$shape" >&2
  echo "/tmp/manta-e2e/qwen3-$shape"
}

# Starts `worker --listen 127.0.0.1:PORT [--gpus G]` in DIR (its own working directory),
# logging to LOG; waits until it listens. Prints its pid.
start_worker() {
  local dir=$1 log=$2 port=$3 gpus=$4
  mkdir -p "$dir"
  (cd "$dir" && RUST_LOG=info exec "$BIN/worker" --listen "127.0.0.1:$port" ${gpus:+--gpus "$gpus"}) >"$log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 100); do (exec 3<>/dev/tcp/127.0.0.1/"$port") 2>/dev/null && break; sleep 0.1; done
  echo "$pid"
}

for mode in "${MODES[@]}"; do
  dir=$OUT/workers_$mode; rm -rf "$dir"; mkdir -p "$dir"
  extra=()
  case $mode in
    nccl|grpc)
      model=$(model_for 0.6b)
      cluster=configs/.gpu2-worker-$mode.toml
      sed -e "s/^worker_weights = .*/worker_weights = \"$mode\"/" configs/gpu2-worker-nccl.toml > "$cluster"
      pids=("$(start_worker "$dir/worker" "$dir/worker.log" 7101 1)")
      ;;
    trainer-nccl|trainer-grpc)
      model=$(model_for 0.6b)
      cluster=configs/.gpu2-workers-$mode.toml
      sed -e "s/^worker_weights = .*/worker_weights = \"${mode#trainer-}\"/" \
        configs/gpu2-workers-trainer-nccl.toml > "$cluster"
      pids=("$(start_worker "$dir/worker-a" "$dir/worker-a.log" 7101 0)"
            "$(start_worker "$dir/worker-b" "$dir/worker-b.log" 7102 1)")
      read -r -a extra <<< "${DRIVER_ARGS:-}"
      ;;
    trainer-store)
      model=$(model_for tiny)
      cluster=configs/.gpu2-workers-$mode.toml
      # Same layout without GPUs: no `gpus` keys, CPU engines, the store backend.
      sed -e 's/^worker_weights = .*/worker_weights = "store"/' -e '/^gpus = /d' \
        -e 's/^gpus_per_engine = .*/gpus_per_engine = 0/' \
        configs/gpu2-workers-trainer-nccl.toml > "$cluster"
      pids=("$(start_worker "$dir/worker-a" "$dir/worker-a.log" 7101 "")"
            "$(start_worker "$dir/worker-b" "$dir/worker-b.log" 7102 "")")
      read -r -a extra <<< "${DRIVER_ARGS:---rollout-batch-size 8 --n-samples 4 --max-response-len 8 --max-tokens-per-gpu 8192}"
      ;;
    trainer-dp2|trainer-dp2-store)
      cluster=configs/.gpu2-workers-$mode.toml
      if [ "$mode" = trainer-dp2 ]; then
        model=$(model_for 0.6b)
        cp configs/gpu2-workers-trainer-dp2.toml "$cluster"
        gpu_a=0 gpu_b=1 local_ranks='gpus = [0, 1]' default_args=""
      else
        # Same layout without GPUs: CPU ranks (the store group), a CPU engine, the store
        # backend for its weights.
        model=$(model_for tiny)
        sed -e 's/^worker_weights = .*/worker_weights = "store"/' -e '/^gpus = /d' \
          -e 's/^ranks = .*/ranks = [{ node = 0 }, { node = 1 }]/' \
          -e 's/^gpus_per_engine = .*/gpus_per_engine = 0/' -e '/^colocate = /d' \
          -e '/^mem_fraction_static = /d' configs/gpu2-workers-trainer-dp2.toml > "$cluster"
        gpu_a="" gpu_b="" local_ranks='data_parallel_ranks = 2'
        default_args="--rollout-batch-size 4 --n-samples 4 --max-response-len 8 --max-tokens-per-gpu 8192"
      fi
      pids=("$(start_worker "$dir/worker-a" "$dir/worker-a.log" 7101 "$gpu_a")"
            "$(start_worker "$dir/worker-b" "$dir/worker-b.log" 7102 "$gpu_b")")
      # The runs on the saved rollouts take the same DRIVER_ARGS (batch shape and all).
      read -r -a dp2_args <<< "${DRIVER_ARGS:-$default_args}"
      extra=("${dp2_args[@]}" --save-debug-rollout-data "$dir/debug/debug_{rollout_id}.jsonl")
      ;;
    *) echo "unknown mode $mode (nccl, grpc, trainer-nccl, trainer-grpc, trainer-store, trainer-dp2, trainer-dp2-store)" >&2; exit 2 ;;
  esac
  watcher=""
  if [ -n "${FAULT:-}" ]; then
    who=${FAULT%@*}; at=${FAULT#*@}
    case $who in engine|engine-sync|rank1-train) k=1 port=7102 gpu=1 name=b ;;
      trainer|trainer-train|trainer-sync) k=0 port=7101 gpu=0 name=a ;;
      *) echo "FAULT=$FAULT: expected engine@N, engine-sync@N, trainer@N, trainer-train@N, trainer-sync@N or rank1-train@N" >&2; exit 2 ;; esac
    [[ $mode == *-store ]] && gpu=""
    if [[ $mode == trainer-dp2* ]]; then
      # A lost rank is re-created (the whole group restarts from each node's last
      # checkpoint); the runs on the saved rollouts are skipped.
      sed -i 's/^on_failure = .*/on_failure = "restart"/' "$cluster"
    fi
    (
      until grep -qE "^step +$at/" "$dir/progress.txt" 2>/dev/null; do sleep 0.05; done
      if [[ $who == *-sync ]]; then   # the next broadcast's start on worker A
        seen=$(grep -c "broadcasting the trainer's weights" "$dir/worker-a.log")
        until [ "$(grep -c "broadcasting the trainer's weights" "$dir/worker-a.log")" -gt "$seen" ]; do sleep 0.005; done
      elif [[ $who == *-train ]]; then   # mid-way through the next step's training
        seen=$(grep -c "training step started" "$dir/worker-$name.log")
        until [ "$(grep -c "training step started" "$dir/worker-$name.log")" -gt "$seen" ]; do sleep 0.01; done
        sleep "${FAULT_DELAY_S:-0.5}"
      fi
      kill -9 "${pids[$k]}"; echo "$(date +%s.%N) SIGKILL worker-$name (the $who's) after step $at" >> "$dir/fault.txt"
      sleep "${FAULT_RESTART_S:-3}"
      start_worker "$dir/worker-$name" "$dir/worker-$name.restarted.log" "$port" "$gpu" > "$dir/restarted.pid"
      echo "$(date +%s.%N) worker-$name started again" >> "$dir/fault.txt"
    ) &
    watcher=$!
  fi
  status=0
  MANTA_VERIFY_WEIGHT_SYNC=${VERIFY:-1} RUST_LOG=info "$BIN/driver" --cluster "$cluster" --model "$model" \
    --runs-dir "$dir/runs" --run-name "$mode" --num-rollout "$STEPS" "${extra[@]}" \
    2>"$dir/driver.log" | tee "$dir/progress.txt" || status=$?
  if [[ $mode == trainer-dp2* ]] && [ "$status" -eq 0 ] && [ -z "${FAULT:-}" ]; then
    # The saved rollouts again, trained by the ranks on the workers: each worker keeps
    # its rank's checkpoint under its own directory.
    dp2_steps=${DP2_STEPS:-3}
    RUST_LOG=info "$BIN/driver" --cluster "$cluster" --model "$model" \
      --runs-dir "$dir/runs" --run-name dp2-workers --num-rollout "$dp2_steps" "${dp2_args[@]}" \
      --load-debug-rollout-data "$dir/debug/debug_{rollout_id}.jsonl" \
      --save "$dir/ckpt-dp2-workers" --save-interval "$dp2_steps" \
      2>"$dir/driver-dp2-workers.log" | tee "$dir/progress-dp2-workers.txt" || status=$?
  fi
  # The workers are not this shell's children (started in a subshell): poll until gone,
  # so the next mode can take their ports.
  if [ -n "$watcher" ]; then
    kill "$watcher" 2>/dev/null || true
    [ -f "$dir/restarted.pid" ] && pids+=("$(cat "$dir/restarted.pid")")
    python3 - "$dir/runs/$mode/trained_ids.jsonl" <<'PY' | tee -a "$dir/fault.txt"
import collections, json, sys
ids = [i for l in open(sys.argv[1]) for i in json.loads(l)["ids"]]
twice = [i for i, n in collections.Counter(ids).items() if n > 1]
print(f"trained_ids: {len(ids)} samples, {len(set(ids))} distinct, trained twice: {twice[:10]}")
PY
  fi
  for pid in "${pids[@]}"; do
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  done
  rm -f "$cluster"
  if [[ $mode == trainer-dp2* ]] && [ "$status" -eq 0 ] && [ -z "${FAULT:-}" ]; then
    # The same rollouts trained by local-mode ranks on the same GPUs (the workers are
    # gone): the dp2 config's [train] keys under `[trainer] gpus = [0, 1]` (the CPU
    # analogue: data_parallel_ranks = 2).
    local_cluster=configs/.gpu2-local-dp2.toml
    { printf '[cluster]\nmode = "local"\ntrain_config = "multiturn.yaml"\n\n[trainer]\n%s\n\n' "$local_ranks"
      sed -n '/^\[train\]/,$p' configs/gpu2-workers-trainer-dp2.toml; } > "$local_cluster"
    RUST_LOG=info "$BIN/driver" --cluster "$local_cluster" --model "$model" \
      --runs-dir "$dir/runs" --run-name dp2-local --num-rollout "$dp2_steps" "${dp2_args[@]}" \
      --load-debug-rollout-data "$dir/debug/debug_{rollout_id}.jsonl" \
      --save "$dir/ckpt-dp2-local" --save-interval "$dp2_steps" \
      2>"$dir/driver-dp2-local.log" | tee "$dir/progress-dp2-local.txt" || status=$?
    rm -f "$local_cluster"
    step_dir=$(printf 'step_%06d' "$dp2_steps")
    [ "$status" -eq 0 ] && { python3 bench/py/compare_weights.py \
      "worker A rank 0=$dir/worker-a/manta-checkpoints/dp2-workers/$step_dir/model.safetensors" \
      "worker B rank 1=$dir/worker-b/manta-checkpoints/dp2-workers/$step_dir/model.safetensors" \
      "local ranks=$dir/ckpt-dp2-local/$step_dir/model.safetensors" \
      | tee "$dir/compare.txt" || status=$?; }
  fi
  [ "$status" -eq 0 ] || { echo "$mode failed (exit $status)"; tail -n 20 "$dir/driver.log"; continue; }
  grep -m1 "weight sync route" "$dir/driver.log" | sed 's/\x1b\[[0-9;]*m//g' || true
  python3 - "$dir/runs/$mode/metrics.jsonl" "$mode" "$dir/sync_per_step.tsv" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
with open(sys.argv[3], "w") as f:
    f.write("step\tupdate_weights_time_s\tpause_to_resume_time_s\n")
    for r in rows:
        f.write(f"{r['step']}\t{r['perf/update_weights_time']:.6f}\t{r['perf/pause_to_resume_time']:.6f}\n")
med = lambda k: statistics.median(r[k] for r in rows[1:] if k in r)
print(f"{sys.argv[2]}: {len(rows)} steps, median step {med('perf/step_time'):.3f} s, "
      f"sync {med('perf/update_weights_time'):.4f} s, pause {med('perf/pause_to_resume_time'):.4f} s "
      f"(per step: {sys.argv[3]})")
PY
done
