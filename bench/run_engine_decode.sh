#!/usr/bin/env bash
# Runs on the GPU machine (device tool): the native engine's decode throughput and
# transformers `generate` in the same run, Qwen3-0.6B and Qwen3-8B shapes (random bf16),
# prompt 512, 256 new tokens; writes $OUT/engine_decode.json. Binaries come from bin/.
# BATCHES_0_6B / BATCHES_8B / SKIP_HF / MANTA_SHAPES (the Manta runs: "0.6b 8b") /
# HF_SHAPES (the transformers runs; default MANTA_SHAPES) override what runs, so a table
# can be split over calls of at most 10 minutes, each shape's pair in one call.
set -euo pipefail
TL=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib
export LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# MANTA_DEVICE_KIND names the device-tool kind in the results (e.g. nvidia-h100-x1).
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
B06=${BATCHES_0_6B:-1,16,64,256}
B8=${BATCHES_8B:-1,16,64,256}
SHAPES=${MANTA_SHAPES:-0.6b 8b}
if [[ " $SHAPES " == *" 0.6b "* ]]; then
  ./bin/engine_decode 0.6b "$B06" 2> >(tee "$OUT/manta_0_6b.log" >&2) > "$OUT/manta_0_6b.json"
fi
if [[ " $SHAPES " == *" 8b "* ]]; then
  ./bin/engine_decode 8b "$B8" 2> >(tee "$OUT/manta_8b.log" >&2) > "$OUT/manta_8b.json"
fi
HF=${HF_SHAPES:-$SHAPES}
if [ -z "${SKIP_HF:-}" ]; then
  if [[ " $HF " == *" 0.6b "* ]]; then
    python3 bench/py/engine_decode_hf.py 0.6b "$B06" > "$OUT/hf_0_6b.json"
  fi
  if [[ " $HF " == *" 8b "* ]]; then
    python3 bench/py/engine_decode_hf.py 8b "${HF_BATCHES_8B:-$B8}" > "$OUT/hf_8b.json"
  fi
fi
python3 bench/py/engine_decode_report.py "$OUT"
