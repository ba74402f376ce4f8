#!/usr/bin/env bash
# Runs on the GPU machine (device tool): Manta's model_step and the transformers
# baseline in the same run; writes $OUT/model_step.json. Binaries come from bin/.
set -euo pipefail
TL=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib
export LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
ARGS="${ARGS:-8 2048 10}"
./bin/model_step $ARGS | tee "$OUT/manta.json"
python3 bench/py/model_step_hf.py $ARGS | tee "$OUT/hf.json"
python3 - "$OUT" <<'PY'
import json, sys, os
out = sys.argv[1]
m = json.load(open(os.path.join(out, "manta.json")))
h = json.load(open(os.path.join(out, "hf.json")))
res = {
    "device": os.environ.get("MANTA_DEVICE_KIND", "device machine") + ": " + h["gpu"] + ", torch " + h["torch"],
    "date": __import__("datetime").date.today().isoformat(),
    "benchmark": "Qwen3-0.6B-shaped random model, bf16, forward+backward, next-token loss",
    "batch": m["batch"], "seq": m["seq"], "iters": m["iters"], "gpu": h["gpu"], "torch": h["torch"],
    "manta_tokens_per_s": m["tokens_per_s"], "pytorch_eager_tokens_per_s": h["tokens_per_s"],
    "manta_median_s": m["median_s"], "pytorch_eager_median_s": h["median_s"],
    "speedup_vs_pytorch_eager": m["tokens_per_s"] / h["tokens_per_s"],
    "baseline": h["impl"],
}
json.dump(res, open(os.path.join(out, "model_step.json"), "w"), indent=2)
print(f"{'impl':<40}{'tokens/s':>14}{'median s':>12}")
print(f"{'manta (tch)':<40}{m['tokens_per_s']:>14.0f}{m['median_s']:>12.4f}")
print(f"{h['impl']:<40}{h['tokens_per_s']:>14.0f}{h['median_s']:>12.4f}")
print(f"speedup_vs_pytorch_eager = {res['speedup_vs_pytorch_eager']:.3f}")
PY
