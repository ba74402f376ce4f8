#!/usr/bin/env bash
# Runs on the GPU machine (device tool, a two-GPU kind): the trainer's shardings side by
# side (bin/trainer_dp, one process per GPU, NCCL), random Qwen3-shape weights made here.
# PARTS picks what runs (default "big mid cp"):
# Every layer is recomputed in the backward (RECOMPUTE=1) for 8B and 4B; CP_RECOMPUTE=1
# does the same for the context-parallel runs.
#   big  8B shape, 16k tokens per GPU (GLOBAL8=8 samples of SEQ8=4096 tokens, 4 per rank),
#        each card held to GPU_CAP_GIB (default 79.6: an 80 GB H100, also on an H200;
#        GPU_CAP_GIB= empty: the whole card):
#        ZeRO-2 (expected to run out of memory) then ZeRO-3 with --grad-reduce-in-bf16
#        (GRAD_REDUCE_BF16=1: a bf16 reduced-gradient shard); BIG_FP32_GRADS=1 adds ZeRO-3
#        with fp32 gradient shards (big_zero3_fp32grads); BIG_ZERO2=0 skips ZeRO-2;
#        RECOMPUTE_LAYERS=N recomputes only the first N layers (block method) instead
#        of every layer; STEPS steps, ITERS timed.
#   mid  4B shape, where both fit (no cap): ZeRO-2 and ZeRO-3 tokens/s on the same batch.
#   cp   0.6B shape (CP_SHAPE), one multi-turn-length sample of CP_SEQ=32768 tokens:
#        context parallel over 2 GPUs vs one GPU; the losses and tokens/s side by side.
# MANTA_TRAINER_PROFILE=1 (inherited by the ranks) adds each rank's median seconds per
# step phase (forward, backward, ZeRO gathers and reduce-scatters, CP collectives,
# optimizer, ...; docs/knobs.md) to its JSON and to the run's row as `profile`; the
# profile syncs the GPU at every phase boundary, so its steps run slower than unprofiled.
# Writes $OUT/trainer_shards.json (+ the ranks' logs and JSON; each run's row names the
# driver flags it stands for); prints a summary.
# Binaries come from bin/ (cargo build --release -p manta-bench --bin trainer_dp).
set -uo pipefail
TL=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib
export LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
W=${WORK:-/tmp/manta_shards}; mkdir -p "$W"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
PARTS=${PARTS:-big mid cp}; STEPS=${STEPS:-3}; ITERS=${ITERS:-2}
GPU_CAP=${GPU_CAP_GIB-79.6}; GLOBAL8=${GLOBAL8:-8}; SEQ8=${SEQ8:-4096}
CP_SHAPE=${CP_SHAPE:-0.6b}; CP_SEQ=${CP_SEQ:-32768}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF-expandable_segments:True}

model() {  # model SHAPE: the random model's directory, made once
  [ -f "$W/$1/model.safetensors" ] || ./bin/trainer_dp init "$W/$1" "$1" 2>>"$OUT/init.log"
  echo "$W/$1"
}

# pair NAME SHAPE MODE GLOBAL SEQ [CAP [RECOMPUTE [GRAD_REDUCE_BF16]]]: two ranks, one
# per GPU; logs and JSON as NAME_r*.
pair() {
  local name=$1 dir; dir=$(model "$2")
  rm -f "$W/nccl.id"
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 200 > "$OUT/$name.mem" &
  local smi=$! pids=() rc=0
  for r in 0 1; do
    GPU_CAP_GIB=${6:-} RECOMPUTE=${7:-0} GRAD_REDUCE_BF16=${8:-0} ./bin/trainer_dp run $r 2 "$W/nccl.id" "$dir" "$4" "$5" "$STEPS" "$ITERS" bf16 - "$3" \
      > "$OUT/${name}_r$r.json" 2> "$OUT/${name}_r$r.log" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  kill "$smi" 2>/dev/null; wait "$smi" 2>/dev/null
  echo "== $name rc=$rc"; tail -n 2 "$OUT/${name}_r0.log" | cut -c1-300
  echo "$rc" > "$OUT/$name.rc"
}

for part in $PARTS; do
  case $part in
    big) [ "${BIG_ZERO2:-1}" = 1 ] && pair big_zero2 8b zero2 "$GLOBAL8" "$SEQ8" "$GPU_CAP" 1
         pair big_zero3 8b zero3 "$GLOBAL8" "$SEQ8" "$GPU_CAP" 1 1
         [ "${BIG_FP32_GRADS:-0}" = 1 ] &&
           pair big_zero3_fp32grads 8b zero3 "$GLOBAL8" "$SEQ8" "$GPU_CAP" 1 0 ;;
    mid) pair mid_zero2 4b zero2 "$GLOBAL8" "$SEQ8" "" 1
         pair mid_zero3 4b zero3 "$GLOBAL8" "$SEQ8" "" 1 ;;
    cp)  pair cp2 "$CP_SHAPE" cp 1 "$CP_SEQ" "" "${CP_RECOMPUTE:-0}"
         RECOMPUTE=${CP_RECOMPUTE:-0} ./bin/trainer_dp run 0 1 - "$(model "$CP_SHAPE")" 1 "$CP_SEQ" "$STEPS" "$ITERS" bf16 - cp \
           > "$OUT/cp1_r0.json" 2> "$OUT/cp1_r0.log"; echo "$?" > "$OUT/cp1.rc"
         echo "== cp1 rc=$(cat "$OUT/cp1.rc")"; tail -n 2 "$OUT/cp1_r0.log" | cut -c1-300 ;;
    *) echo "unknown part $part (big, mid, cp)"; exit 2 ;;
  esac
done

python3 - "$OUT" "$W" "$GPU_CAP" <<'PY'
import datetime, json, os, sys
import torch
out, work = sys.argv[1], sys.argv[2]
cap = float(sys.argv[3]) if sys.argv[3] else None
PEAK_TFLOPS = 989.4  # H100/H200 SXM dense bf16

def rank_json(name, r):
    try:
        return json.load(open(os.path.join(out, f"{name}_r{r}.json")))
    except (OSError, ValueError):
        return None

def error(name):
    log = os.path.join(out, f"{name}_r0.log")
    lines = [l.strip() for l in open(log, errors="replace")] if os.path.exists(log) else []
    hits = [l for l in lines if "out of memory" in l.lower() or "error" in l.lower()]
    return (hits or lines or ["no log"])[-1][:400]

def smi_peak(name):
    mem = {}
    path = os.path.join(out, f"{name}.mem")
    if os.path.exists(path):
        for line in open(path):
            p = [x.strip() for x in line.split(",")]
            if len(p) == 2 and p[1].isdigit():
                mem[p[0]] = max(mem.get(p[0], 0), int(p[1]))
    return mem

def model_flops_per_token(shape, seq):
    cfg = json.load(open(os.path.join(work, shape, "config.json")))
    h, i, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    nh, nkv, hd, v = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["vocab_size"]
    per_layer = h * nh * hd * 2 + h * nkv * hd * 2 + 3 * h * i
    n = L * per_layer + v * h  # matmul weights: layers and the LM head
    # 6 N per token, plus causal attention (QK^T and AV, half the square): 6 L s d.
    return 6 * n + 6 * L * seq * nh * hd

def flags(name):
    # As the rank printed them at start (its JSON repeats them when it finished).
    log = os.path.join(out, f"{name}_r0.log")
    for line in open(log, errors="replace") if os.path.exists(log) else []:
        if "as the driver's" in line:
            return line.split("as the driver's", 1)[1].strip()
    return None

def run(name, shape, ranks=(0, 1)):
    r = [rank_json(name, k) for k in ranks]
    row = {"ok": all(x is not None for x in r), "flags": flags(name)}
    if not row["ok"]:
        row["error"] = error(name)
        row["nvidia_smi_peak_mib"] = smi_peak(name)
        return row
    seq = r[0]["seq"]
    tps = r[0]["global_tokens_per_s"]
    row.update({
        "losses": [s["loss"] for s in r[0]["steps"]],
        "median_step_s": max(x["median_s"] for x in r),
        "global_tokens_per_s": tps,
        "peak_allocated_gib": [x["peak_allocated_gib"] for x in r],
        "plan": r[0].get("plan"), "shard_gib": r[0].get("shard_gib"),
        "nvidia_smi_peak_mib": smi_peak(name),
        "global_samples": r[0]["global_samples"], "seq": seq,
        "mfu": tps * model_flops_per_token(shape, seq) / (len(ranks) * PEAK_TFLOPS * 1e12),
    })
    if any(x.get("profile") for x in r):
        row["profile"] = [x.get("profile") for x in r]  # per rank, MANTA_TRAINER_PROFILE=1
    return row

names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
res = {"device": os.environ.get("MANTA_DEVICE_KIND", "two-GPU kind") + ": " + names + ", torch " + torch.__version__,
       "date": datetime.date.today().isoformat(),
       "benchmark": "trainer shardings (bin/trainer_dp, NCCL, bf16 with fp32 masters, GRPO loss), random Qwen3-shape weights",
       "mfu_basis": f"6 x matmul params + causal attention per token, {PEAK_TFLOPS} TFLOP/s per GPU"}
have = lambda n: os.path.exists(os.path.join(out, f"{n}.rc"))
if have("big_zero3"):
    z2, z3 = run("big_zero2", "8b"), run("big_zero3", "8b")
    res["8b_16k_per_gpu"] = {"gpu_cap_gib": cap, "zero2": z2, "zero3": z3}
    if have("big_zero3_fp32grads"):
        res["8b_16k_per_gpu"]["zero3_fp32grads"] = run("big_zero3_fp32grads", "8b")
    res["zero3_8b_mfu"] = z3.get("mfu")
if have("mid_zero3"):
    z2, z3 = run("mid_zero2", "4b"), run("mid_zero3", "4b")
    res["4b"] = {"zero2": z2, "zero3": z3}
    if z2.get("ok") and z3.get("ok"):
        res["zero3_over_zero2_tokens_per_s_4b"] = z3["global_tokens_per_s"] / z2["global_tokens_per_s"]
if have("cp1"):
    shape = os.environ.get("CP_SHAPE", "0.6b")
    c2, c1 = run("cp2", shape), run("cp1", shape, ranks=(0,))
    res["cp"] = {"shape": shape, "cp2": c2, "cp1": c1}
    if c2.get("ok") and c1.get("ok"):
        res["cp"]["loss_rel_diff"] = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(c2["losses"], c1["losses"])]
        res["cp2_over_cp1_tokens_per_s"] = c2["global_tokens_per_s"] / c1["global_tokens_per_s"]
json.dump(res, open(os.path.join(out, "trainer_shards.json"), "w"), indent=2)
print(json.dumps(res, indent=1)[:6000])
PY
