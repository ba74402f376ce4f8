#!/usr/bin/env bash
# Runs on the GPU machine (device tool, one GPU): kernel variants of one native-engine decode
# step, side by side in one process — bin/decode_step replays each variant's CUDA graph in
# turn (median of 5 rounds of 200 replays) after checking its logits against the tensor ops,
# so a variant that skips work fails instead of looking fast. "default" (the build's
# settings) always runs first, as the baseline.
#
# usage: bash bench/run_decode_step.sh SHAPE BATCH CONTEXT [VARIANT ...]
#   SHAPE 0.6b | 8b; VARIANT is NAME:KEY=VALUE,KEY=VALUE with knobs of docs/knobs.md, e.g.
#   bash bench/run_decode_step.sh 8b 1 640 nk2:MANTA_GEMV_NORM_KSPLIT=2 k1:MANTA_GEMV_KSPLIT=1
# At 8B every variant holds its own copy of the model (16 GB): up to 4 variants on an H100,
# 7 on an H200.
#
# TRACE=1 also traces the engine's prefill and 32 decode steps with programmatic dependent
# launch off (MANTA_PDL=0: a kernel's time is then its own, not partly its wait for the one
# before) and sums the decode steps' kernels by launch shape (bench/py/kernel_summary.py
# --by-launch), so each projection's GEMV shows apart. TRACE_ENV adds knobs to that run.
#
# Writes $OUT/decode_step_<shape>_b<B>.json ({"device", "date", "command", "result"}) and, with
# TRACE=1, $OUT/launches_<shape>_b<B>.txt. Needs bin/decode_step (and bin/engine_decode for
# TRACE): cargo build --release -p manta-bench --bin decode_step --bin engine_decode, carried.
set -euo pipefail
if [ $# -lt 3 ]; then
  sed -n '8,12p' "$0" >&2
  exit 2
fi
SHAPE=$1 BATCH=$2 CONTEXT=$3; shift 3
for bin in decode_step ${TRACE:+engine_decode}; do
  [ -x "bin/$bin" ] || { echo "error: bin/$bin missing (cargo build --release -p manta-bench --bin $bin; carry bin)" >&2; exit 1; }
done
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
TL=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib
export LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-}
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
KEY="${SHAPE//./_}_b$BATCH"
./bin/decode_step "$SHAPE" "$BATCH" "$CONTEXT" default "$@" > "$OUT/decode_step_$KEY.raw" 2> >(tee "$OUT/decode_step_$KEY.log" >&2)
P_COMMAND="bash bench/run_decode_step.sh $SHAPE $BATCH $CONTEXT $*" P_DEVICE="${MANTA_DEVICE_KIND:-gpu}: $GPU" \
  python3 - "$OUT/decode_step_$KEY.raw" "$OUT/decode_step_$KEY.json" <<'PY'
import datetime, json, os, sys
result = json.load(open(sys.argv[1]))
json.dump({"device": os.environ["P_DEVICE"], "date": datetime.date.today().isoformat(),
           "command": os.environ["P_COMMAND"], "result": result}, open(sys.argv[2], "w"), indent=1)
base = result["variants"][0]["median_us"]
for v in result["variants"]:
    print(f"{v['variant']:>14}: {v['median_us']:9.1f} us/step  {v['median_us'] / base:6.3f} x default")
PY
rm -f "$OUT/decode_step_$KEY.raw"
if [ -n "${TRACE:-}" ]; then
  T=$(mktemp -d)
  # shellcheck disable=SC2086
  env ${TRACE_ENV:-} MANTA_PDL=0 MANTA_TORCH_PROFILE="$T" ./bin/engine_decode "$SHAPE" "$BATCH" 512 64 > /dev/null 2> "$OUT/trace_$KEY.log"
  # The prefill's kernels are in it too, as launch shapes of their own (grids of many tokens).
  python3 bench/py/kernel_summary.py "$T/engine_decode_${SHAPE}_b$BATCH.json" --by-launch --top 16 | tee "$OUT/launches_$KEY.txt"
  rm -rf "$T"
fi
