#!/usr/bin/env bash
# Manta's native engine against SGLang on the same GPU, the same model shapes and the same
# static batch: Qwen3-0.6B and Qwen3-8B shapes with random bf16 weights, B requests of a
# 512-token prompt and 256 greedy new tokens (EOS ignored), B = 1, 64, 256. Runs on the
# device machine (one GPU, H100 or H200); writes $OUT/peers.json and $OUT/peers.md and
# prints the table (bench/py/peers_report.py).
#
#   native  bin/engine_decode SHAPE B1,B2,.. PROMPT NEW   (bench/src/bin/engine_decode.rs: the
#           whole engine — scheduler, paged KV, CUDA graphs, overlap schedule — behind
#           concurrent generate() calls; per batch an untimed 8-token run first, then the
#           timed run, then three prefill-only runs (1 new token) whose median is prefill_s)
#   sglang  python3 -m sglang.bench_one_batch (SGLang 0.5.17: sglang/benchmark/one_batch.py)
#           --load-format dummy --attention-backend flashinfer on a config-only model
#           directory from bench/py/e2e_model.py (the same Qwen3 shapes), ModelRunner
#           driven directly: one prefill of the whole batch, then NEW-1 decode steps, the
#           device synchronised after each step (no scheduler, no overlap schedule); its
#           JSONL result file is what is parsed. The batch list runs twice in one process
#           (SGLANG_PASSES=2) and the last record of each batch is kept, so every batch is
#           measured warm, as engine_decode warms each batch first.
#
# The same definitions on both sides (per shape and batch B, NEW new tokens):
#   prefill_s      prefill of the B prompts plus the first token.
#                  native: median of 3 runs of B requests with max_new_tokens 1;
#                  sglang: prefill_latency (one extend() forward + sample, synchronised).
#   decode tok/s   B*(NEW-1) / (time of the whole run - prefill_s): the decode phase alone.
#                  native: decode_tokens_per_s = B*(NEW-1)/(wall_s - prefill_s);
#                  sglang: B*(NEW-1)/(total_latency - prefill_latency), the mean over the
#                  NEW-1 steps (its own median-step figure, median_decode_throughput, is
#                  kept beside it as sglang_median_decode_tokens_per_s).
#   e2e tok/s      B*NEW / (prefill + decode time): output tokens over the whole run.
#                  native: tokens_per_s = tokens/wall_s; sglang: B*NEW/total_latency (its
#                  overall_throughput counts prompt tokens too, (IN+OUT)*B/total_latency:
#                  kept as sglang_overall_throughput, not compared).
#   ratios         native_over_sglang_decode_<shape>_b<B> = native decode / sglang decode,
#                  native_over_sglang_e2e_<shape>_b<B> = native e2e / sglang e2e,
#                  native_over_sglang_prefill_<shape>_b<B> = sglang prefill_s / native
#                  prefill_s; > 1 means Manta is faster. <shape> is written 0_6b or 8b.
#
# Env: SHAPES ("0.6b 8b"), BATCHES ("1,64,256"; commas or spaces), PROMPT (512), NEW (256),
#   SIDES ("native sglang"), SGLANG_ENV (/tmp/site/sglang_env.sh, sourced if present),
#   SGLANG_MEM_FRACTION (0.7: weights + KV pool; leaves room for the 131k-token prefill
#   of B=256 at 8B, which bench_one_batch runs in one forward), SGLANG_PASSES (2),
#   SGLANG_GRAPH_BS (exact: CUDA graphs captured only for the sizes run — decode graphs of
#   the batch list, prefill graphs of the B*PROMPT token counts up to 8192 — the buckets
#   SGLang's defaults would use for them, minus the ~90 others; a shorter start.
#   "default" keeps SGLang's lists), SGLANG_ATTENTION_BACKEND (flashinfer; FA3 is not in
#   the offline bundle),
#   SGLANG_EXTRA_ARGS (appended to bench_one_batch's arguments, word-split),
#   NATIVE_TIMEOUT_S (240 per shape), SGLANG_TIMEOUT_S (420 per shape), BUDGET_S (550:
#   the whole call; each run gets at most what is left minus 15 s for the report),
#   MANTA_DEVICE_KIND (the device-tool kind, named in "device").
#
# Estimated times on one H100 (defaults): native 0.6b ~40 s, native 8b ~90 s; SGLang's first
# start compiles flashinfer's JIT kernels (~3-4 min, cached under ~/.cache/flashinfer for
# later processes on the same machine), so sglang 0.6b ~4-5 min, sglang 8b ~1.5-2 min:
# ~8-9 minutes in all. Runs go native 0.6b, native 8b, sglang 0.6b, sglang 8b; a run that
# would pass BUDGET_S is cut (recorded as an error) and the report is still written. If the
# last one is cut, run `SHAPES=8b SIDES=sglang bash bench/run_peers.sh` in a second call on
# the same warm machine (kernels cached) and merge: python3 bench/py/peers_report.py DIR1 DIR2.
#
# ROLLOUT=1 adds the multi-turn rollout step through each engine, via bench/run_e2e.sh. No
# one-GPU SGLang rollout config exists (configs/gpu-colocated.toml is native only), so it
# needs TWO GPUs (kind nvidia-h100-x2) and its own call: `ROLLOUT=1 DECODE=0 bash
# bench/run_peers.sh` runs `bench/run_e2e.sh disagg-sync` (configs/gpu-disagg.toml: trainer
# GPU 0, native engine GPU 1) and `bench/run_e2e.sh sglang-disagg`
# (configs/gpu-sglang-disagg.toml: trainer GPU 0, SGLang server GPU 1, weights over NCCL),
# ROLLOUT_STEPS (10) steps each, bin/driver and bin/otlp_sink carried, into
# $OUT/rollout_native/ and $OUT/rollout_sglang/; peers_report.py reads their
# e2e_<mode>.json (rollout_s, rollout_tokens_per_s) and writes
# rollout_step_native_over_sglang = sglang rollout_s / native rollout_s and
# rollout_tokens_per_s_native_over_sglang. ~7-8 minutes: native ~2, SGLang ~5.5 (its server's
# first start ~4 of them); ROLLOUT_TIMEOUT_S (420 per mode; BUDGET_S still bounds the call),
# ROLLOUT_SHAPE (0.6b; MODEL_SHAPE of run_e2e.sh). A run cut before run_e2e.sh's own report
# is summarised from its runs/MODE/metrics.jsonl (e2e_report.py's summarise()).
#
# Device call (one GPU; SGLang installed earlier on the same warm machine with
# `bash .whl/sgb/install.sh /tmp/sgb_parts`, see bench/sglang/README.md; carry ["bin"]):
#   MANTA_DEVICE_KIND=nvidia-h100-x1 bash bench/run_peers.sh
set -euo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1   # complete logs from a python process that timeout stops
T0=$(date +%s)
BUDGET_S=${BUDGET_S:-550}
SHAPES=${SHAPES:-0.6b 8b}
BATCHES=${BATCHES:-1,64,256}
PROMPT=${PROMPT:-512}
NEW=${NEW:-256}
SIDES=${SIDES:-native sglang}
DECODE=${DECODE:-1}
ROLLOUT=${ROLLOUT:-0}
read -r -a BLIST <<< "${BATCHES//,/ }"
BCSV=$(IFS=,; echo "${BLIST[*]}")
RUNS="$OUT/peers_runs.tsv"; : > "$RUNS"
has() { [[ " $1 " == *" $2 "* ]]; }
key_of() { echo "${1//./_}"; }
left() { echo $(( BUDGET_S - ($(date +%s) - T0) - 15 )); }

# SGLang's environment (the offline bundle puts /tmp/site first on PYTHONPATH).
SGLANG_ENV=${SGLANG_ENV:-/tmp/site/sglang_env.sh}
SGLANG_VERSIONS='{}'
if has "$SIDES" sglang && [ "$DECODE" = 1 ] || [ "$ROLLOUT" = 1 ]; then
  if [ -f "$SGLANG_ENV" ]; then
    # shellcheck disable=SC1090
    source "$SGLANG_ENV"
    echo "[peers] sourced $SGLANG_ENV"
  else
    echo "[peers] $SGLANG_ENV not found; using python3's own sglang, if any"
  fi
  if ! SGLANG_VERSIONS=$(python3 -c '
import json, importlib.metadata as m, sglang
v = {"sglang": getattr(sglang, "__version__", None)}
for d in ("flashinfer-python", "sglang-kernel", "torch", "transformers"):
    try: v[d] = m.version(d)
    except Exception: v[d] = None
print(json.dumps(v))' 2> "$OUT/sglang_import.log"); then
    echo "ERROR: python3 cannot import sglang. Install the bundle first on this machine:" >&2
    echo "  bash .whl/sgb/install.sh /tmp/sgb_parts; source /tmp/site/sglang_env.sh   (bench/sglang/README.md)" >&2
    echo "  or point SGLANG_ENV at the env file; or run SIDES=native. python3 said:" >&2
    tail -n 5 "$OUT/sglang_import.log" >&2
    exit 3
  fi
  echo "[peers] $SGLANG_VERSIONS"
fi

# libtorch's libraries for bin/engine_decode (as bench/run_engine_decode.sh).
TL=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))' 2>/dev/null || true)
[ -z "$TL" ] || export LD_LIBRARY_PATH=$TL/lib:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
NGPU=$(grep -c . "$OUT/gpu.txt" || true)

COMMAND=${PEERS_COMMAND:-"SHAPES='$SHAPES' BATCHES='$BCSV' PROMPT=$PROMPT NEW=$NEW SIDES='$SIDES' DECODE=$DECODE ROLLOUT=$ROLLOUT bash bench/run_peers.sh"}
COMMIT=${MANTA_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
P_COMMAND=$COMMAND P_SHAPES=$SHAPES P_BATCHES=$BCSV P_PROMPT=$PROMPT P_NEW=$NEW P_SIDES=$SIDES \
P_DECODE=$DECODE P_ROLLOUT=$ROLLOUT P_COMMIT=$COMMIT P_VERSIONS=$SGLANG_VERSIONS \
P_MEMF=${SGLANG_MEM_FRACTION:-0.7} P_PASSES=${SGLANG_PASSES:-2} P_GRAPH=${SGLANG_GRAPH_BS:-exact} \
P_EXTRA=${SGLANG_EXTRA_ARGS:-} P_BUDGET=$BUDGET_S python3 - "$OUT/peers_meta.json" <<'PY'
import json, os, re, sys
e = os.environ
KNOBS = set(re.findall(r"^\| `(MANTA_[A-Z0-9_]+)`", open("docs/knobs.md").read(), re.M))
json.dump({"command": e["P_COMMAND"], "shapes": e["P_SHAPES"].split(),
           "batches": [int(b) for b in e["P_BATCHES"].split(",") if b],
           "prompt": int(e["P_PROMPT"]), "new_tokens": int(e["P_NEW"]), "sides": e["P_SIDES"].split(),
           "decode": e["P_DECODE"] == "1", "rollout": e["P_ROLLOUT"] == "1",
           "device_kind": e.get("MANTA_DEVICE_KIND", ""), "manta_commit": e["P_COMMIT"],
           "budget_s": int(e["P_BUDGET"]), "sglang_versions": json.loads(e["P_VERSIONS"] or "{}"),
           "sglang_args": {"mem_fraction_static": e["P_MEMF"], "passes": int(e["P_PASSES"]),
                           "decode_graph_bs": e["P_GRAPH"], "extra": e["P_EXTRA"]},
           # The native side's tuning knobs set for this run (the table of docs/knobs.md),
           # for A/B tables; other MANTA_* variables are not knobs.
           "manta_knobs": {k: v for k, v in sorted(e.items()) if k in KNOBS}},
          open(sys.argv[1], "w"), indent=1)
PY

REPORTED=0
report() {
  [ "$REPORTED" = 0 ] || return 0
  REPORTED=1
  python3 bench/py/peers_report.py "$OUT" || echo "[peers] peers_report.py failed" >&2
}
trap report EXIT

# run SIDE SHAPE LIMIT STDOUT LOG CMD...: CMD under `timeout`, for at most LIMIT seconds and
# what is left of BUDGET_S; its stdout to STDOUT, its stderr to LOG (both to LOG, appended, when
# they are the same file); one line "side shape rc seconds limit" into peers_runs.tsv. Never fails.
run() {
  local side=$1 shape=$2 limit=$3 stdout=$4 log=$5; shift 5
  local t rc=0 t1
  t=$(left); [ "$t" -lt "$limit" ] || t=$limit
  if [ "$t" -lt 30 ]; then
    echo "[peers] $side $shape: skipped, ${t}s of BUDGET_S=$BUDGET_S left" | tee -a "$log"
    printf '%s\t%s\t%s\t%s\t%s\n' "$side" "$shape" budget 0 "$t" >> "$RUNS"
    return 0
  fi
  echo "[peers] $side $shape (limit ${t}s): $*"
  t1=$(date +%s)
  if [ "$stdout" = "$log" ]; then
    timeout -k 20 "$t" "$@" >> "$log" 2>&1 || rc=$?
  else
    timeout -k 20 "$t" "$@" > "$stdout" 2> "$log" || rc=$?
  fi
  printf '%s\t%s\t%s\t%s\t%s\n' "$side" "$shape" "$rc" "$(( $(date +%s) - t1 ))" "$t" >> "$RUNS"
  echo "[peers] $side $shape: exit $rc after $(( $(date +%s) - t1 ))s"
  if [ "$rc" != 0 ]; then tail -n 15 "$log" >&2 || true; fi
  return 0
}

if [ "$DECODE" = 1 ] && has "$SIDES" native; then
  [ -x bin/engine_decode ] || echo "[peers] bin/engine_decode missing (carry [\"bin\"]; cargo build --release -p manta-bench --bin engine_decode)" >&2
  for shape in $SHAPES; do
    k=$(key_of "$shape")
    rm -f "$OUT/native_$k.json"
    run native "$shape" "${NATIVE_TIMEOUT_S:-240}" "$OUT/native_$k.json" "$OUT/native_$k.log" \
      ./bin/engine_decode "$shape" "$BCSV" "$PROMPT" "$NEW"
    grep -E 'batch +[0-9]+:' "$OUT/native_$k.log" || true
  done
fi

if [ "$DECODE" = 1 ] && has "$SIDES" sglang; then
  passes=()
  for _ in $(seq 1 "${SGLANG_PASSES:-2}"); do passes+=("${BLIST[@]}"); done
  # CUDA graphs for exactly the sizes these runs use: decode graphs of the batch sizes, and
  # the prefill (breakable) graphs of the batches' token counts that SGLang would graph at
  # all (<= chunked_prefill_size, 8192 on H100/H200); the same buckets the defaults pick
  # for these sizes, without capturing the ~90 others (a shorter start).
  graph=()
  if [ "${SGLANG_GRAPH_BS:-exact}" = exact ]; then
    pre=()
    for b in "${BLIST[@]}"; do [ $(( b * PROMPT )) -gt 8192 ] || pre+=($(( b * PROMPT ))); done
    graph=(--cuda-graph-bs-decode "${BLIST[@]}")
    if [ ${#pre[@]} -gt 0 ]; then graph+=(--cuda-graph-bs-prefill "${pre[@]}"); else graph+=(--disable-prefill-cuda-graph); fi
  fi
  read -r -a extra <<< "${SGLANG_EXTRA_ARGS:-}"
  for shape in $SHAPES; do
    k=$(key_of "$shape")
    model=/tmp/manta-peers/qwen3-$shape
    : > "$OUT/sglang_$k.log"
    python3 bench/py/e2e_model.py assets/tiny-qwen3 "$model" "$shape" 2>> "$OUT/sglang_$k.log" \
      || echo "[peers] e2e_model.py failed for $shape" >&2
    rm -f "$OUT/sglang_$k.jsonl"   # bench_one_batch appends
    run sglang "$shape" "${SGLANG_TIMEOUT_S:-420}" "$OUT/sglang_$k.log" "$OUT/sglang_$k.log" \
      python3 -m sglang.bench_one_batch --model-path "$model" --load-format dummy \
        --attention-backend "${SGLANG_ATTENTION_BACKEND:-flashinfer}" --dtype bfloat16 \
        --mem-fraction-static "${SGLANG_MEM_FRACTION:-0.7}" "${graph[@]}" \
        --batch-size "${passes[@]}" --input-len "$PROMPT" --output-len "$NEW" \
        --run-name "peers_$k" --result-filename "$OUT/sglang_$k.jsonl" "${extra[@]}"
    grep -E '^(max_total_num_tokens|skipping|Total\.)' "$OUT/sglang_$k.log" | tail -n $(( 2 * ${#BLIST[@]} + 1 )) || true
    sleep 3   # the process's GPU memory returns before the next one starts
  done
fi

if [ "$ROLLOUT" = 1 ]; then
  if [ "$NGPU" -lt 2 ]; then
    echo "[peers] ROLLOUT=1 needs 2 GPUs (trainer GPU 0, engine GPU 1); this machine has $NGPU" >&2
    printf '%s\t%s\t%s\t%s\t%s\n' rollout all "needs 2 GPUs, found $NGPU" 0 0 >> "$RUNS"
  else
    for side in native sglang; do
      mode=disagg-sync; [ "$side" = sglang ] && mode=sglang-disagg
      mkdir -p "$OUT/rollout_$side"
      run "rollout_$side" "$mode" "${ROLLOUT_TIMEOUT_S:-420}" "$OUT/rollout_$side/run.log" "$OUT/rollout_$side/run.log" \
        env OUT="$OUT/rollout_$side" STEPS="${ROLLOUT_STEPS:-10}" MODEL_SHAPE="${ROLLOUT_SHAPE:-0.6b}" \
        bash bench/run_e2e.sh "$mode"
      tail -n 4 "$OUT/rollout_$side/run.log" || true
    done
  fi
fi

trap - EXIT
report
