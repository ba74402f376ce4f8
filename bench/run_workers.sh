#!/usr/bin/env bash
# Remote mode on one two-GPU host (configs/gpu2-worker-nccl.toml): the trainer in the
# driver on GPU 0, a `worker` daemon hosting a native engine on GPU 1, STEPS steps of the
# multi-turn loop per MODE, every sync verified bit for bit (MANTA_VERIFY_WEIGHT_SYNC=1):
#   nccl   cluster.worker_weights = "nccl": one broadcast group rooted in the driver
#   grpc   the same layout with weights as gRPC chunks (the baseline)
# Writes $OUT/workers_MODE/ (driver.log, worker.log, progress.txt, runs/) and prints each
# mode's median sync time (perf/update_weights_time) and step time.
#
# Here (no GPU needed):  bench/run_workers.sh build   # release driver + worker into bin/
# There (device tool, 2 GPUs, carry ["bin"]):  bench/run_workers.sh nccl grpc
# MODEL_SHAPE=8b gives the random model Qwen3-8B's shape.
set -euo pipefail
if [ "${1:-}" = build ]; then
  cargo build --release -p manta-driver --bin driver --bin worker
  mkdir -p bin && cp target/release/driver target/release/worker bin/ && strip bin/driver bin/worker
  exit 0
fi
TL=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib
export LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${STEPS:-20}; SHAPE=${MODEL_SHAPE:-0.6b}
MODEL=/tmp/manta-e2e/qwen3-$SHAPE
python3 bench/py/e2e_model.py assets/tiny-qwen3 "$MODEL" "$SHAPE"
export MANTA_CLUSTER_TOKEN=${MANTA_CLUSTER_TOKEN:-bench-workers-token}
MODES=("$@"); [ ${#MODES[@]} -gt 0 ] || MODES=(nccl grpc)
for mode in "${MODES[@]}"; do
  case $mode in nccl|grpc) ;; *) echo "unknown mode $mode (nccl, grpc)" >&2; exit 2 ;; esac
  dir=$OUT/workers_$mode; mkdir -p "$dir/worker"
  cluster=configs/.gpu2-worker-$mode.toml
  sed -e "s/^worker_weights = .*/worker_weights = \"$mode\"/" configs/gpu2-worker-nccl.toml > "$cluster"
  (cd "$dir/worker" && RUST_LOG=info exec "$OLDPWD/bin/worker" --listen 127.0.0.1:7101) >"$dir/worker.log" 2>&1 &
  worker=$!
  for _ in $(seq 1 100); do (exec 3<>/dev/tcp/127.0.0.1/7101) 2>/dev/null && break; sleep 0.1; done
  status=0
  MANTA_VERIFY_WEIGHT_SYNC=1 RUST_LOG=info ./bin/driver --cluster "$cluster" --model "$MODEL" \
    --runs-dir "$dir/runs" --run-name "$mode" --num-rollout "$STEPS" \
    2>"$dir/driver.log" | tee "$dir/progress.txt" || status=$?
  kill "$worker" 2>/dev/null || true; wait "$worker" 2>/dev/null || true
  [ "$status" -eq 0 ] || { echo "$mode failed (exit $status)"; tail -n 20 "$dir/driver.log"; }
  python3 - "$dir/runs/$mode/metrics.jsonl" "$mode" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
med = lambda k: statistics.median(r[k] for r in rows[1:] if k in r)
print(f"{sys.argv[2]}: {len(rows)} steps, median step {med('perf/step_time'):.3f} s, "
      f"sync {med('perf/update_weights_time'):.4f} s, pause {med('perf/pause_to_resume_time'):.4f} s")
PY
done
