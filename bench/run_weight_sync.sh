#!/usr/bin/env bash
# Runs on the GPU machine (device tool), one GPU: weight sync between two processes on
# that GPU through CUDA IPC (Manta's shim) and through torch.multiprocessing in the same
# run, plus the native engine's pause-to-resume for an in-process update; Qwen3-0.6B and
# Qwen3-8B shapes, random bf16. Writes $OUT/weight_sync.json. Binaries come from bin/.
# SHAPES / REPS / SKIP_TORCH override what runs.
set -euo pipefail
TL=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib
export LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# MANTA_DEVICE_KIND names the device-tool kind in the results (e.g. nvidia-h100-x1).
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
REPS=${REPS:-10}
for shape in ${SHAPES:-0.6b 8b}; do
  key=${shape/./_}
  ./bin/weight_sync_ipc ipc "$shape" "$REPS" 2> >(tee "$OUT/ipc_$key.log" >&2) > "$OUT/ipc_$key.json"
  ./bin/weight_sync_ipc engine "$shape" "$REPS" 2> >(tee "$OUT/engine_$key.log" >&2) > "$OUT/engine_$key.json"
  if [ -z "${SKIP_TORCH:-}" ]; then
    python3 bench/py/weight_sync_ipc_torch.py "$shape" "$REPS" > "$OUT/torch_$key.json"
  fi
done
python3 bench/py/weight_sync_report.py "$OUT"
