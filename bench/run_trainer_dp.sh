#!/usr/bin/env bash
# Runs on the GPU machine (device tool, a two-GPU kind: nvidia-h100-x2 or nvidia-h200-x2):
# data-parallel trainer ranks (bin/trainer_dp, one process per GPU, NCCL through cudarc,
# ZeRO-2) against one rank on the same global batch, Qwen3 shape SHAPE (0.6b, or 8b),
# random weights made once in the run. For each precision in PRECISIONS (default "bf16 fp32"):
#   - 2 ranks (cuda:0, cuda:1), GLOBAL/2 samples each (fp32: FP32_GLOBAL/2): STEPS
#     checked steps, weights written, then ITERS timed steps;
#   - 1 rank (cuda:0) on all GLOBAL samples (in two micro-batches of GLOBAL/2): the same.
# Reports loss / grad-norm agreement, the two ranks' weights (bit-identical expected),
# the DP weights against the single rank's, peak memory per GPU (caching allocator and
# nvidia-smi) and step times; dp2_scaling_efficiency = t(1 GPU) / (2 × t(2 GPUs)) for
# the same global batch. Writes $OUT/trainer_dp.json. DP1=0 skips the single rank (a
# shape one GPU cannot hold, e.g. SHAPE=8b) and writes $OUT/trainer_dp_SHAPE.json.
# Binaries come from bin/.
set -euo pipefail
TL=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib
export LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
W=${WORK:-/tmp/manta_dp}; rm -rf "$W"; mkdir -p "$W"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
SHAPE=${SHAPE:-0.6b}; DP1=${DP1:-1}; GLOBAL=${GLOBAL:-16}; SEQ=${SEQ:-2048}; STEPS=${STEPS:-2}; ITERS=${ITERS:-5}
# fp32 activations take twice the memory: half the samples keep a micro-batch's bytes.
FP32_GLOBAL=${FP32_GLOBAL:-8}
PRECISIONS=${PRECISIONS:-bf16 fp32}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF-expandable_segments:True}

./bin/trainer_dp init "$W/model" "$SHAPE" 2> >(tee "$OUT/init.log" >&2)
for prec in $PRECISIONS; do
  g=$GLOBAL; [ "$prec" = fp32 ] && g=$FP32_GLOBAL
  # Per-GPU memory in use (MiB) while the two ranks run.
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 200 > "$OUT/dp2_$prec.mem" &
  smi=$!
  rm -f "$W/nccl.id"   # rank 0 writes a new one
  pids=()
  for r in 0 1; do
    ./bin/trainer_dp run $r 2 "$W/nccl.id" "$W/model" "$g" "$SEQ" "$STEPS" "$ITERS" "$prec" \
      "$W/w_${prec}_dp2_r$r.safetensors" > "$OUT/dp2_${prec}_r$r.json" 2> "$OUT/dp2_${prec}_r$r.log" &
    pids+=($!)
  done
  rc=0; for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  kill "$smi" 2>/dev/null; wait "$smi" 2>/dev/null || true
  tail -n 5 "$OUT"/dp2_${prec}_r*.log
  [ "$rc" = 0 ] || { echo "a data-parallel rank failed (rc $rc)"; exit 1; }
  if [ "$DP1" = 0 ]; then cat "$OUT"/dp2_${prec}_r*.json; continue; fi
  ./bin/trainer_dp run 0 1 - "$W/model" "$g" "$SEQ" "$STEPS" "$ITERS" "$prec" \
    "$W/w_${prec}_dp1.safetensors" > "$OUT/dp1_$prec.json" 2> >(tee "$OUT/dp1_$prec.log" >&2)
  cat "$OUT"/dp2_${prec}_r*.json "$OUT/dp1_$prec.json"
done
if [ "$DP1" = 0 ]; then   # a shape one GPU cannot hold: the two ranks alone
  python3 - "$OUT" "$W" "$SHAPE" $PRECISIONS <<'PY'
import datetime, json, os, sys
import torch
from safetensors.torch import load_file
out, work, shape, precs = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
res = {"device": os.environ.get("MANTA_DEVICE_KIND", "two-GPU kind") + ": "
       + ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())),
       "date": datetime.date.today().isoformat(), "shape": shape,
       "benchmark": "data-parallel GRPO steps (NCCL, ZeRO-2), 2 ranks, random weights"}
for prec in precs:
    r = [json.load(open(os.path.join(out, f"dp2_{prec}_r{i}.json"))) for i in (0, 1)]
    w0, w1 = (load_file(os.path.join(work, f"w_{prec}_dp2_r{i}.safetensors")) for i in (0, 1))
    res[prec] = {"losses": [s["loss"] for s in r[0]["steps"]],
                 "ranks_weights_identical": all(torch.equal(w0[k], w1[k]) for k in w0),
                 "median_step_s": max(x["median_s"] for x in r),
                 "global_tokens_per_s": r[0]["global_tokens_per_s"],
                 "peak_allocated_gib": [x["peak_allocated_gib"] for x in r]}
    print(prec, json.dumps(res[prec]))
json.dump(res, open(os.path.join(out, f"trainer_dp_{shape}.json"), "w"), indent=2)
PY
  exit 0
fi

python3 - "$OUT" "$W" $PRECISIONS <<'PY'
import datetime, json, os, sys
import torch
from safetensors.torch import load_file
out, work, precs = sys.argv[1], sys.argv[2], sys.argv[3:]
res = {
    "device": os.environ.get("MANTA_DEVICE_KIND", "nvidia-h200-x2") + ": "
    + ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    + ", torch " + torch.__version__,
    "date": datetime.date.today().isoformat(),
    "benchmark": "data-parallel GRPO steps (NCCL, ZeRO-2), 2 ranks vs 1 rank on the same global batch, random Qwen3-0.6B-shape weights",
}
rows = []
for prec in precs:
    r0, r1 = (json.load(open(os.path.join(out, f"dp2_{prec}_r{r}.json"))) for r in (0, 1))
    one = json.load(open(os.path.join(out, f"dp1_{prec}.json")))
    w0, w1, w = (load_file(os.path.join(work, f"w_{prec}_{n}.safetensors"))
                 for n in ("dp2_r0", "dp2_r1", "dp1"))
    ranks_identical = all(torch.equal(w0[k], w1[k]) for k in w0)
    # Adam turns summation-order noise in near-zero gradients into whole steps, so the
    # update's relative L2 difference is the readable figure: ||w_dp2 - w_dp1|| / ||w_dp1 - w_init||.
    init = load_file(os.path.join(work, "model", "model.safetensors"))
    num = sum(((w0[k].double() - w[k].double()) ** 2).sum().item() for k in w)
    den = sum(((w[k].double() - init[k].double()) ** 2).sum().item() for k in w if k in init)
    update_rel_diff = (num / den) ** 0.5 if den > 0 else float("nan")
    diffs = [(w0[k].double() - w[k].double()).abs() for k in w]
    max_diff = max(d.max().item() for d in diffs)
    frac = sum((d > 0).sum().item() for d in diffs) / sum(d.numel() for d in diffs)
    steps = []
    for s2, s1 in zip(r0["steps"], one["steps"]):
        steps.append({k: {"dp2": s2[k], "dp1": s1[k],
                          "rel_diff": abs(s2[k] - s1[k]) / max(abs(s1[k]), 1e-12)}
                      for k in ("loss", "grad_norm")})
    mem = {}
    path = os.path.join(out, f"dp2_{prec}.mem")
    for line in open(path):
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[1].isdigit():
            mem[parts[0]] = max(mem.get(parts[0], 0), int(parts[1]))
    t2 = max(r0["median_s"], r1["median_s"])
    t1 = one["median_s"]
    res[prec] = {
        "steps": steps,
        "dp2_ranks_weights_identical": ranks_identical,
        "dp2_vs_dp1_weights_max_abs_diff": max_diff,
        "dp2_vs_dp1_weights_fraction_differing": frac,
        "dp2_vs_dp1_update_rel_l2_diff": update_rel_diff,
        "dp2_median_step_s": t2, "dp1_median_step_s": t1,
        "dp2_global_tokens_per_s": r0["global_tokens_per_s"],
        "dp1_global_tokens_per_s": one["global_tokens_per_s"],
        "dp2_scaling_efficiency": t1 / (2 * t2),
        "peak_allocated_gib": {"dp2_rank0": r0["peak_allocated_gib"], "dp2_rank1": r1["peak_allocated_gib"],
                               "dp1": one["peak_allocated_gib"]},
        "dp2_peak_gpu_memory_used_mib_nvidia_smi": mem,
        "global_samples": one["global_samples"], "seq": one["seq"],
    }
    rows.append((prec, steps[-1]["loss"]["rel_diff"], ranks_identical, max_diff, update_rel_diff, t1, t2, t1 / (2 * t2),
                 r0["peak_allocated_gib"], one["peak_allocated_gib"]))
if "bf16" in res:
    res["dp2_scaling_efficiency"] = res["bf16"]["dp2_scaling_efficiency"]
json.dump(res, open(os.path.join(out, "trainer_dp.json"), "w"), indent=2)
print(f"{'prec':<6}{'loss rel':>10}{'ranks ==':>10}{'max |dw|':>11}{'rel dW':>9}{'t dp1':>8}{'t dp2':>8}{'eff':>6}{'GiB dp2':>9}{'GiB dp1':>9}")
for r in rows:
    print(f"{r[0]:<6}{r[1]:>10.2e}{str(r[2]):>10}{r[3]:>11.2e}{r[4]:>9.2e}{r[5]:>8.3f}{r[6]:>8.3f}{r[7]:>6.3f}{r[8]:>9.2f}{r[9]:>9.2f}")
if "dp2_scaling_efficiency" in res:
    print(f"dp2_scaling_efficiency = {res['dp2_scaling_efficiency']:.3f}")
PY
