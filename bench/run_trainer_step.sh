#!/usr/bin/env bash
# Runs on the GPU machine (device tool): one GRPO training step of Manta's trainer
# (bin/trainer_step) and of the PyTorch eager baseline (bench/py/trainer_step_eager.py)
# in the same run, Qwen3-0.6B and Qwen3-4B shapes (random bf16 weights made in the run),
# SAMPLES x SEQ tokens per GPU; writes $OUT/trainer_step.json. Binaries come from bin/.
# MANTA_DEVICE_KIND names the device-tool kind in the results; PEAK_TFLOPS overrides the
# dense bf16 peak used for MFU (default: from the GPU's name). RECOMPUTE_0_6B and
# RECOMPUTE_4B (none | all | N | auto; defaults none and auto) choose how many of the first
# layers each side recomputes (Megatron's block method); auto makes each side find the
# fewest that fit in this GPU's memory at this batch, by trying steps.
set -euo pipefail
TL=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib
export LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
SAMPLES=${SAMPLES:-8}; SEQ=${SEQ:-2048}; ITERS=${ITERS:-5}
RECOMPUTE_0_6B=${RECOMPUTE_0_6B:-none}; RECOMPUTE_4B=${RECOMPUTE_4B:-auto}
# Both sides use libtorch's caching allocator, which reads this: expandable segments
# leave less memory stranded by fragmentation, so fewer layers need recomputing.
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF-expandable_segments:True}
# Highest GPU memory in use (MiB, nvidia-smi: what the process holds, caches included)
# while a command runs.
peak_mem() {
  local log=$1; shift
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > "$log.mem" &
  local smi=$!
  "$@"; local rc=$?
  kill "$smi" 2>/dev/null; wait "$smi" 2>/dev/null || true
  return $rc
}
SHAPES=${SHAPES:-0.6b 4b}
for shape in $SHAPES; do
  tag=${shape/./_}
  rc_var=RECOMPUTE_${tag^^}; rc=${!rc_var}
  peak_mem "$OUT/manta_$tag" ./bin/trainer_step "$shape" "$SAMPLES" "$SEQ" "$ITERS" "$rc" 2> >(tee "$OUT/manta_$tag.log" >&2) > "$OUT/manta_$tag.json"
  cat "$OUT/manta_$tag.json"
  peak_mem "$OUT/eager_$tag" python3 bench/py/trainer_step_eager.py "$shape" "$SAMPLES" "$SEQ" "$ITERS" "$rc" 2> >(tee "$OUT/eager_$tag.log" >&2) > "$OUT/eager_$tag.json"
  cat "$OUT/eager_$tag.json"
done
python3 - "$OUT" $SHAPES <<'PY'
import datetime, json, os, sys, time
import torch
out, shapes = sys.argv[1], sys.argv[2:]
SHAPES = {  # layers, hidden, intermediate, heads, kv heads, head_dim, vocab (tied)
    "0.6b": (28, 1024, 3072, 16, 8, 128, 151936),
    "4b": (36, 2560, 9728, 32, 8, 128, 151936),
}

def flops(shape, r):
    """Model FLOPs of one training step (forward + backward = 3x forward): 6 x matmul
    parameters x tokens for the decoder, 6 x vocab x hidden per response token for the
    LM head (only trained tokens get logits), causal attention 6 x seq^2 x head_dim per
    head, layer and sample. Recomputation under gradient checkpointing is not counted."""
    L, h, i, nh, nkv, hd, v = SHAPES[shape]
    layer = h * nh * hd * 2 + 2 * h * nkv * hd + 3 * h * i
    tokens = r["samples"] * r["seq"]
    attn = 6 * r["seq"] ** 2 * hd * nh * L * r["samples"]
    return 6 * layer * L * tokens + 6 * v * h * r["response_tokens"] + attn

name = torch.cuda.get_device_name(0)
# Dense bf16 tensor-core peaks from NVIDIA's data sheets (no sparsity).
peaks = [("H200", 989.4), ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.4), ("A100", 312.0)]
peak = float(os.environ["PEAK_TFLOPS"]) if os.environ.get("PEAK_TFLOPS") else next((p for k, p in peaks if k in name), None)
# What a large bf16 matmul reaches here, for context.
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16); b = torch.randn_like(a)
for _ in range(3): a @ b
torch.cuda.synchronize(); ts = []
for _ in range(10):
    t = time.perf_counter(); a @ b; torch.cuda.synchronize(); ts.append(time.perf_counter() - t)
matmul_tflops = 2 * 8192 ** 3 / sorted(ts)[5] / 1e12
res = {
    "device": os.environ.get("MANTA_DEVICE_KIND", "device machine") + ": " + name + ", torch " + torch.__version__,
    "date": datetime.date.today().isoformat(),
    "benchmark": "one GRPO step (clipped loss vs rollout log-probs, per-sample mean, grad clip, AdamW with fp32 masters), random bf16 Qwen3 shapes",
    "peak_bf16_tflops": peak, "peak_source": "PEAK_TFLOPS" if os.environ.get("PEAK_TFLOPS") else "data-sheet dense bf16 for " + name,
    "measured_bf16_matmul_tflops": matmul_tflops,
    "dp2_scaling_efficiency": None,
    "dp2_scaling_efficiency_reason": "not measured by this one-GPU script: bench/run_trainer_dp.sh (nvidia-h200-x2) measures it",
}
rows = []
for shape in shapes:
    tag = shape.replace(".", "_")
    m = json.load(open(os.path.join(out, f"manta_{tag}.json")))
    e = json.load(open(os.path.join(out, f"eager_{tag}.json")))
    f = flops(shape, m)
    for who, r in (("manta", m), ("pytorch_eager", e)):
        tflops = f / r["median_s"] / 1e12
        keys = ("impl", "samples", "seq", "response_tokens", "gradient_checkpointing", "recompute",
                "recompute_num_layers", "num_layers", "recompute_choice", "recompute_probes",
                "timed_oom_splits", "warmup_oom_retries", "timed_oom_retries", "median_s", "tokens_per_s", "loss", "grad_norm")
        res[f"{who}_{tag}"] = {k: r[k] for k in keys if k in r}
        mem = os.path.join(out, f"{'manta' if who == 'manta' else 'eager'}_{tag}.mem")
        if os.path.exists(mem):
            used = [int(x) for x in open(mem).read().split() if x.strip().isdigit()]
            if used:
                res[f"{who}_{tag}"]["peak_gpu_memory_used_mib_nvidia_smi"] = max(used)
        res[f"{who}_{tag}"]["model_tflops_per_s"] = tflops
        res[f"{who}_{tag}"]["mfu"] = tflops / peak if peak else None
        if "peak_memory_gib" in r:
            res[f"{who}_{tag}"]["peak_memory_gib"] = r["peak_memory_gib"]
        rows.append((f"{who} {shape}", r["tokens_per_s"], r["median_s"], tflops, tflops / peak if peak else float("nan")))
    res[f"model_flops_per_step_{tag}"] = f
    res[f"speedup_vs_pytorch_eager_{tag}"] = m["tokens_per_s"] / e["tokens_per_s"]
if "manta_4b" in res:
    res["mfu_4b"] = res["manta_4b"]["mfu"]
    res["recompute_num_layers"] = res["manta_4b"].get("recompute_num_layers")
res["recompute_note"] = (
    "each side recomputes (checkpoints) the first recompute_num_layers layers (Megatron's block "
    "method; transformers' per-layer gradient_checkpointing for eager), chosen per side as the "
    "fewest that fit this GPU at this batch (RECOMPUTE_4B=" + os.environ.get("RECOMPUTE_4B", "auto")
    + "); model FLOPs do not count recomputation; both sides ran with PYTORCH_CUDA_ALLOC_CONF="
    + os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
json.dump(res, open(os.path.join(out, "trainer_step.json"), "w"), indent=2)
print(f"{'impl':<24}{'tokens/s':>12}{'median s':>10}{'TFLOP/s':>10}{'MFU':>8}")
for r in rows:
    print(f"{r[0]:<24}{r[1]:>12.0f}{r[2]:>10.3f}{r[3]:>10.1f}{r[4]:>8.3f}")
print(f"peak {peak} TFLOP/s ({res['peak_source']}); measured 8192^3 bf16 matmul {matmul_tflops:.0f} TFLOP/s")
for k in ("speedup_vs_pytorch_eager_0_6b", "speedup_vs_pytorch_eager_4b", "mfu_4b"):
    if k in res:
        print(f"{k} = {res[k]:.3f}")
PY
