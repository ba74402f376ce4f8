#!/usr/bin/env bash
# Runs on the GPU machine (device tool, one GPU): the whole-step peer benchmark, TRL's
# GRPOTrainer against Manta's colocated loop at the same shape, one after the other on GPU 0.
#   1. installs the carried TRL bundle offline (bench/trl/install.sh; TRL_WHEELS, default
#      .devpack/trl_wheels.tar.xz, made here by `bash bench/trl/pack.sh .devpack`);
#   2. writes the random Qwen3 model dir of MODEL_SHAPE (bench/py/e2e_model.py) and runs
#      bench/py/trl_grpo_step.py: STEPS optimizer steps, each BATCH prompts x N_SAMPLES
#      completions of at most MAX_RESPONSE_LEN tokens through transformers' generate, the
#      digits reward, MICRO_BATCH completions per forward/backward, AdamW; once per
#      micro-batch size in MICRO_BATCH (a list): the fastest is the baseline;
#   3. runs Manta's loop at that shape: `bash bench/run_e2e.sh colocated` (its built-in
#      multi-turn environments, configs/multiturn.yaml) and, unless MANTA_DIGITS=0, the same
#      cluster with --config train_config.yaml (the single-turn digits task TRL runs too, so
#      both sides do the same work per step);
#   4. writes $OUT/trl_step.json: both median step times (the first step of each left out),
#      manta_over_trl_step = trl_step_s / manta_step_s (above 1: Manta's step is shorter),
#      the rollout/train split and tokens per step of each side, "device", "date", "command".
# Needs bin/driver and bin/otlp_sink (bench/run_e2e.sh build here; carry bin, or carry
# .devpack/manta.tar.xz, unpacked into bin when bin/driver is missing; MANTA_TARBALL names
# another, such as the .devpack/manta-<commit>.tar.xz of bench/pack_bin.sh). Other knobs: STEPS (4), BATCH (32), N_SAMPLES (8), MAX_RESPONSE_LEN (64),
# MODEL_SHAPE (0.6b | 8b, as bench/run_e2e.sh), MICRO_BATCH ("64 256": TRL's micro-batch
# sizes to run, each dividing BATCH x N_SAMPLES; 256 at the defaults is the whole step in one
# micro-batch), MANTA_MAX_TOKENS_PER_GPU (Manta's digits run's --max-tokens-per-gpu;
# default BATCH x N_SAMPLES x (MAX_RESPONSE_LEN + 96): the whole step in one micro-batch too,
# for prompts up to 96 tokens), MANTA_MULTITURN (1; 0 skips the multi-turn run), GRAD_CKPT (default: the
# gradient_checkpointing key of configs/gpu-colocated.toml, else true, Manta's default),
# TRL_DTYPE (bf16 | fp32-master), TRL_TIMEOUT / MANTA_TIMEOUT (seconds, 300 each),
# TRL_GPU (0: TRL's Trainer refuses several visible GPUs, so it sees this one only),
# MANTA_DEVICE_KIND (names the kind in "device").
# Run time on one H100/H200 at the defaults: a few minutes (install ~15 s, TRL ~1 min,
# each Manta run ~1 min). Example device call, from the repo root:
#   carry [".devpack"]   command: MANTA_TARBALL=.devpack/manta-<commit>.tar.xz bash bench/run_trl_step.sh
# Files under $OUT: trl_mbN.json and trl_mbN.log per micro-batch size N, install.log, model.log, and run_e2e.sh's own
# (runs/, colocated/, e2e_colocated.json, report.md), colocated-digits/ and
# e2e_colocated-digits.json, trl_step.json.
set -euo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${STEPS:-4}; BATCH=${BATCH:-32}; N_SAMPLES=${N_SAMPLES:-8}; MAX_RESPONSE_LEN=${MAX_RESPONSE_LEN:-64}
MODEL_SHAPE=${MODEL_SHAPE:-0.6b}; MICRO_BATCH=${MICRO_BATCH:-64 256}; TRL_DTYPE=${TRL_DTYPE:-bf16}
MANTA_MAX_TOKENS_PER_GPU=${MANTA_MAX_TOKENS_PER_GPU:-$((BATCH * N_SAMPLES * (MAX_RESPONSE_LEN + 96)))}
MANTA_MULTITURN=${MANTA_MULTITURN:-1}
# TRL recomputes layers in backward as Manta's colocated config does (its key, else Manta's default true).
GRAD_CKPT=${GRAD_CKPT:-$(sed -n 's/^gradient_checkpointing *= *\(true\|false\).*/\1/p' configs/gpu-colocated.toml | head -n 1)}
GRAD_CKPT=${GRAD_CKPT:-true}
TRL_WHEELS=${TRL_WHEELS:-.devpack/trl_wheels.tar.xz}; TRL_SITE=${TRL_SITE:-/tmp/trl_site}
MANTA_DIGITS=${MANTA_DIGITS:-1}; TRL_TIMEOUT=${TRL_TIMEOUT:-300}; MANTA_TIMEOUT=${MANTA_TIMEOUT:-300}
export STEPS BATCH N_SAMPLES MAX_RESPONSE_LEN MODEL_SHAPE MANTA_MAX_TOKENS_PER_GPU
COMMAND="MODEL_SHAPE=$MODEL_SHAPE STEPS=$STEPS BATCH=$BATCH N_SAMPLES=$N_SAMPLES MAX_RESPONSE_LEN=$MAX_RESPONSE_LEN MICRO_BATCH='$MICRO_BATCH' MANTA_MAX_TOKENS_PER_GPU=$MANTA_MAX_TOKENS_PER_GPU GRAD_CKPT=$GRAD_CKPT TRL_DTYPE=$TRL_DTYPE MANTA_DIGITS=$MANTA_DIGITS MANTA_MULTITURN=$MANTA_MULTITURN bash bench/run_trl_step.sh"
[ -f bench/run_e2e.sh ] || { echo "run from the repository root" >&2; exit 2; }
[ "$STEPS" -ge 2 ] || { echo "STEPS must be at least 2 (the first step is warm-up)" >&2; exit 2; }

if [ ! -x bin/driver ]; then
  MANTA_TARBALL=${MANTA_TARBALL:-.devpack/manta.tar.xz}
  [ -f "$MANTA_TARBALL" ] || { echo "no bin/driver and no $MANTA_TARBALL: run 'bash bench/run_e2e.sh build' here and carry bin, or a tar.xz of it named by MANTA_TARBALL" >&2; exit 1; }
  mkdir -p bin && tar -xJf "$MANTA_TARBALL" -C bin
fi
for b in bin/driver bin/otlp_sink; do
  [ -x "$b" ] || { echo "$b is missing: run 'bash bench/run_e2e.sh build' here and carry it" >&2; exit 1; }
done
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
rm -f "$OUT"/trl*.json "$OUT/e2e_colocated.json" "$OUT/e2e_colocated-digits.json" "$OUT/trl_step.json"   # no stale results

echo "== install TRL from $TRL_WHEELS"
trl_rc=0; TRL_PATH=
if bash bench/trl/install.sh "$TRL_WHEELS" "$TRL_SITE" > "$OUT/install.log" 2>&1; then
  tail -n 2 "$OUT/install.log"
  TRL_PATH=$(sed -n 's/^export PYTHONPATH="\([^$"]*\).*/\1/p' "$TRL_SITE/trl_env.sh")
fi
if [ -z "$TRL_PATH" ]; then   # Manta's runs still go ahead; the script fails at the end
  trl_rc=1; cat "$OUT/install.log" >&2; echo "TRL install failed (log above); skipping the TRL run" >&2
fi

E2E_MODEL=/tmp/manta-e2e/qwen3-$MODEL_SHAPE   # the path bench/run_e2e.sh uses and rewrites the same way
python3 bench/py/e2e_model.py assets/tiny-qwen3 "$E2E_MODEL" "$MODEL_SHAPE" 2> "$OUT/model.log"

for mb in $MICRO_BATCH; do
  echo "== TRL GRPOTrainer: $STEPS steps of $BATCH x $N_SAMPLES, <= $MAX_RESPONSE_LEN tokens, micro-batch $mb"
  rc=0
  [ "$trl_rc" -ne 0 ] || PYTHONPATH="$TRL_PATH${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=${TRL_GPU:-0} timeout -k 10 "$TRL_TIMEOUT" python3 bench/py/trl_grpo_step.py \
      --model-dir "$E2E_MODEL" --prompts "$BATCH" --samples "$N_SAMPLES" --max-completion-len "$MAX_RESPONSE_LEN" \
      --steps "$STEPS" --micro-batch "$mb" --gradient-checkpointing "$GRAD_CKPT" --dtype "$TRL_DTYPE" \
      --out "$OUT/trl_mb$mb.json" > /dev/null 2> "$OUT/trl_mb$mb.log" || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "TRL run (micro-batch $mb) failed (exit $rc); last lines of $OUT/trl_mb$mb.log:" >&2; tail -n 30 "$OUT/trl_mb$mb.log" >&2
  elif [ "$trl_rc" -eq 0 ]; then
    grep '^\[trl\] step' "$OUT/trl_mb$mb.log" 2>/dev/null || true
  fi
done

if [ "$MANTA_MULTITURN" = 1 ]; then
  echo "== Manta colocated (bench/run_e2e.sh colocated)"
  manta_rc=0
  timeout -k 10 "$MANTA_TIMEOUT" bash bench/run_e2e.sh colocated || manta_rc=$?
  [ "$manta_rc" -eq 0 ] || echo "bench/run_e2e.sh colocated failed (exit $manta_rc)" >&2
else
  manta_rc=skipped
fi

digits_rc=skipped
if [ "$MANTA_DIGITS" = 1 ]; then
  echo "== Manta colocated, single-turn digits (--config train_config.yaml)"
  TL=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib
  mkdir -p "$OUT/colocated-digits"
  digits_rc=0
  LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-} RUST_LOG=${RUST_LOG:-info} timeout -k 10 "$MANTA_TIMEOUT" \
    ./bin/driver --cluster configs/gpu-colocated.toml --config train_config.yaml --model "$E2E_MODEL" \
      --runs-dir "$OUT/runs" --run-name colocated-digits --num-rollout "$STEPS" \
      --rollout-batch-size "$BATCH" --n-samples "$N_SAMPLES" --max-response-len "$MAX_RESPONSE_LEN" \
      --max-tokens-per-gpu "$MANTA_MAX_TOKENS_PER_GPU" \
      2> "$OUT/colocated-digits/driver.log" | tee "$OUT/colocated-digits/progress.txt" || digits_rc=$?
  if [ "$digits_rc" -ne 0 ]; then
    echo "the digits run failed (exit $digits_rc); last lines of its log:" >&2
    tail -n 30 "$OUT/colocated-digits/driver.log" >&2
  fi
  python3 bench/py/e2e_report.py "$OUT" colocated colocated-digits > /dev/null || true
fi

python3 - "$OUT" "$COMMAND" "$trl_rc" "$manta_rc" "$digits_rc" <<'PY'
import datetime, json, os, statistics, sys
import torch
out, command, trl_rc, manta_rc, digits_rc = sys.argv[1:]

def load(name):
    p = os.path.join(out, name)
    return json.load(open(p)) if os.path.exists(p) else None

def manta_work(mode):
    """Per-step work of a Manta run from its metrics.jsonl (steps after the first, medians)."""
    p = os.path.join(out, "runs", mode, "metrics.jsonl")
    if not os.path.exists(p):
        return {}
    rows = [json.loads(l) for l in open(p) if l.strip()][1:]
    med = lambda f: statistics.median(v for v in (f(r) for r in rows) if v is not None) if rows else None
    g = lambda r, k: r.get(k)
    return {
        "response_len_mean": med(lambda r: g(r, "rollout/response_len/mean")),
        "num_turns_mean": med(lambda r: g(r, "rollout/num_turns/mean")),
        "trained_tokens_per_step": med(lambda r: g(r, "train/tokens")),
        "rollout_tokens_per_step_est": med(lambda r: r["perf/rollout_tokens_per_sec"] * r["perf/rollout_time"]
                                           if r.get("perf/rollout_tokens_per_sec") and r.get("perf/rollout_time") else None),
        "train_tokens_per_step_est": med(lambda r: r["perf/tokens_per_gpu_per_sec"] * r["perf/train_time"]
                                         if r.get("perf/tokens_per_gpu_per_sec") and r.get("perf/train_time") else None),
    }

# One TRL run per micro-batch size; the fastest step is the baseline (the others are kept).
trl_runs = [r for r in (load(n) for n in sorted(os.listdir(out)) if n.startswith("trl_mb") and n.endswith(".json")) if r]
trl = min(trl_runs, key=lambda r: r["step_s"]) if trl_runs else None
manta = load("e2e_colocated.json") if manta_rc != "skipped" else None
digits = load("e2e_colocated-digits.json") if digits_rc != "skipped" else None
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
ratio = lambda a, b: a / b if a is not None and b else None
trl_s = trl and trl["step_s"]
res = {
    "device": os.environ.get("MANTA_DEVICE_KIND", "device machine") + ": " + gpu + ", torch " + torch.__version__,
    "date": datetime.date.today().isoformat(),
    "benchmark": "whole GRPO step (rollout + reward + train + optimizer, one GPU, colocated): TRL GRPOTrainer "
                 "(transformers generate) vs Manta's colocated loop, random Qwen3 weights of MODEL_SHAPE",
    "command": command,
    "shape": {"model": os.environ["MODEL_SHAPE"], "steps": int(os.environ["STEPS"]), "prompts": int(os.environ["BATCH"]),
              "samples": int(os.environ["N_SAMPLES"]), "max_response_len": int(os.environ["MAX_RESPONSE_LEN"])},
    "trl_step_s": trl_s,
    "trl_micro_batch": trl and trl["micro_batch"],
    "manta_digits_step_s": digits and digits["step_s"],
    "manta_multiturn_step_s": manta and manta["step_s"],
    # Like for like: the digits task on both sides (the multi-turn loop does several times the work).
    "manta_over_trl_step": ratio(trl_s, digits and digits["step_s"]),
    "manta_max_tokens_per_gpu": int(os.environ["MANTA_MAX_TOKENS_PER_GPU"]),
    "trl": trl,
    "trl_runs": {f"micro_batch_{r['micro_batch']}": {k: r.get(k) for k in ("step_s", "rollout_s", "train_s", "peak_memory_gib")}
                 for r in trl_runs},
    "manta_colocated": manta and {**manta, "work": manta_work("colocated")},
    "manta_colocated_digits": digits and {**digits, "work": manta_work("colocated-digits")},
    "exit_codes": {"trl": int(trl_rc), "manta_colocated": int(manta_rc) if manta_rc.isdigit() else manta_rc,
                   "manta_digits": int(digits_rc) if digits_rc.isdigit() else digits_rc},
    "notes": [
        "step times are medians over the steps after the first on each side",
        "manta_colocated is bench/run_e2e.sh colocated: configs/multiturn.yaml (digits and the multi-turn "
        "counter environment, a tool-listing system prompt), so its episodes can take several turns of up to "
        "max_response_len tokens each; TRL runs one turn. manta_colocated_digits (train_config.yaml, single-turn "
        "digits, the same reward rule) is the like-for-like pair: compare the tokens per step under 'work'",
        "TRL: generation_batch_size = micro_batch x gradient_accumulation_steps = prompts x samples, one optimizer "
        "step per generation, so TRL skips the old-log-prob forward (num_iterations 1) and has no reference model "
        "(beta 0); Manta recomputes the old log-probs with the trainer unless --use-rollout-logprobs",
        "TRL dtype " + (trl["dtype"] if trl else "?") + ": bf16 = bf16 weights and AdamW state; Manta keeps fp32 "
        "master weights and AdamW state when bf16 is on",
    ],
}
json.dump(res, open(os.path.join(out, "trl_step.json"), "w"), indent=2)
f = lambda v, fmt=".2f": "-" if v is None else format(v, fmt)
print(f"{'side':<28}{'step s':>8}{'rollout s':>11}{'train s':>9}")
for r in trl_runs:
    name = f"TRL {r['trl_version']} mb {r['micro_batch']}"
    print(f"{name:<28}{f(r['step_s']):>8}{f(r['rollout_s']):>11}{f(r['train_s']):>9}")
for name, r in (("Manta colocated", manta), ("Manta colocated digits", digits)):
    if r:
        print(f"{name:<28}{f(r['step_s']):>8}{f(r['rollout_s']):>11}{f(r['train_s']):>9}")
print(f"manta_over_trl_step = {f(res['manta_over_trl_step'], '.3f')} (the digits run against the fastest TRL run)")
missing = [k for k in ("trl_step_s", "manta_digits_step_s") if res[k] is None and (k != "manta_digits_step_s" or digits_rc != "skipped")]
if missing or (manta_rc != "skipped" and res["manta_multiturn_step_s"] is None):
    sys.exit(f"incomplete: no {', '.join(missing) or 'manta_multiturn_step_s'} (see the logs under {out}); "
             "trl_step.json is written all the same")
PY
