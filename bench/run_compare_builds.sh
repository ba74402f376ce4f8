#!/usr/bin/env bash
# Runs on the GPU machine (device tool): the same benchmarks with several builds' binaries,
# in one call on one machine, to show a change that should not change speed did not
# (bench/results/restructure_prepost.json). Each DIR holds engine_decode and trainer_step
# (stripped release binaries of one commit); each runs
#   engine_decode 0.6b 1,64     (prompt 512, 256 new tokens)
#   trainer_step 0.6b 8 2048 5 none
# in the order given, and the table of tokens/s is printed and written to
# $OUT/compare_builds.json.
# Usage: bench/run_compare_builds.sh DIR [DIR ...]
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: $0 DIR [DIR ...] (each with engine_decode and trainer_step)" >&2; exit 2; }
TL=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib
export LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
for d in "$@"; do
  tag=$(basename "$d")
  "$d/engine_decode" 0.6b 1,64 > "$OUT/ed_$tag.json" 2> "$OUT/ed_$tag.log"
  "$d/trainer_step" 0.6b 8 2048 5 none > "$OUT/ts_$tag.json" 2> "$OUT/ts_$tag.log"
done
python3 - "$OUT" "$@" <<'PY'
import json, os, sys
out, dirs = sys.argv[1], sys.argv[2:]
rows = {}
for d in dirs:
    tag = os.path.basename(d.rstrip("/"))
    ed = json.load(open(f"{out}/ed_{tag}.json")); ts = json.load(open(f"{out}/ts_{tag}.json"))
    rows[tag] = {"decode_tokens_per_s": {str(r["batch"]): r["tokens_per_s"] for r in ed["results"]},
                 "trainer_step_tokens_per_s": ts["tokens_per_s"]}
    print(f"{tag:>12}  decode b1 {rows[tag]['decode_tokens_per_s']['1']:8.0f}  "
          f"b64 {rows[tag]['decode_tokens_per_s']['64']:8.0f}  train {ts['tokens_per_s']:8.0f} tok/s")
json.dump(rows, open(f"{out}/compare_builds.json", "w"), indent=1)
PY
