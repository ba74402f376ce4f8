#!/usr/bin/env bash
# Runs on the GPU machine (device tool), two GPUs (nvidia-h200-x2): NCCL weight sync
# between processes, the way SGLang engines receive weights. A Python torch.distributed
# process joins exactly as SGLang's init_custom_process_group does (tcp:// rendezvous,
# PrefixStore(group_name), ProcessGroupNCCL; rank 1 on cuda:1) and receives
#   1. Manta's broadcast (bin/weight_sync_nccl: manta_cuda::process_group, rank 0 on cuda:0),
#      checked bit for bit, then timed;
#   2. torch.distributed's own broadcast of the same tensors (a Python rank 0 on cuda:0),
#      timed the same way in the same run.
#   3. Manta's broadcast into a Manta (Rust) receiver, as an engine on a worker receives
#      (BALLAST_GIB=N first fills N GiB of each GPU, as a trainer and an engine do).
# Qwen3-0.6B-shaped bf16 tensors (hash-generated bits; SHAPE=8b for Qwen3-8B), REPS timed
# rounds each (median, timed on the receiver). Writes $OUT/weight_sync_nccl.json.
# The Python processes run with NCCL_CUMEM_ENABLE=0 as SGLang's server sets it
# (PEER_NCCL_CUMEM overrides); Manta's binary chooses its own (align_nccl_env) unless
# MANTA_NCCL_CUMEM sets it — MANTA_NCCL_CUMEM=1 reproduces the mismatch that fails.
# Binaries come from bin/ (weight_sync_nccl, built with
# `cargo build --release -p manta-bench --bin weight_sync_nccl`).
set -euo pipefail
TL=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib
export LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
GPUS=$(python3 -c 'import torch;print(torch.cuda.device_count())')
if [ "$GPUS" -lt 2 ]; then
  echo "skipped: needs two CUDA devices, this machine has $GPUS (run on nvidia-h200-x2)" >&2
  echo "{\"skipped\": \"needs two CUDA devices, found $GPUS\"}" > "$OUT/weight_sync_nccl.json"
  exit 0
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1 || true
REPS=${REPS:-10}
SHAPE=${SHAPE:-0.6b}
PEER=bench/py/weight_sync_nccl_peer.py
PEER_ENV=(env "NCCL_CUMEM_ENABLE=${PEER_NCCL_CUMEM:-0}")
MANTA_ENV=(env)
[ -n "${MANTA_NCCL_CUMEM:-}" ] && MANTA_ENV=(env "NCCL_CUMEM_ENABLE=$MANTA_NCCL_CUMEM")
MANIFEST=$OUT/manifest.json
# NCCL_DEBUG's lines go to stdout, where the binaries print their JSON: send them to files.
[ -n "${NCCL_DEBUG:-}" ] && export NCCL_DEBUG_FILE=${NCCL_DEBUG_FILE:-$OUT/nccl.%h.%p.log}
free_port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }

# 1. Manta rank 0 -> Python rank 1 (the SGLang side).
rm -f "$MANIFEST"
PORT=$(free_port)
"${MANTA_ENV[@]}" ./bin/weight_sync_nccl send "$PORT" "$REPS" "$MANIFEST" manta_bench "$SHAPE" \
  > "$OUT/manta_send.json" 2> "$OUT/manta_send.log" &
SENDER=$!
for _ in $(seq 600); do [ -f "$MANIFEST" ] && break; sleep 0.1; done
[ -f "$MANIFEST" ] || { echo "weight_sync_nccl wrote no manifest:"; cat "$OUT/manta_send.log"; exit 1; }
"${PEER_ENV[@]}" python3 "$PEER" recv "$PORT" "$REPS" "$MANIFEST" manta_bench "$OUT/manta_recv.json" 2> "$OUT/manta_recv.log" \
  || { echo "receiver failed:"; tail -30 "$OUT/manta_recv.log"; tail -30 "$OUT/manta_send.log"; exit 1; }
wait "$SENDER" || { echo "Manta sender failed:"; tail -30 "$OUT/manta_send.log"; exit 1; }

# 2. torch.distributed rank 0 -> the same receiver code.
PORT=$(free_port)
"${PEER_ENV[@]}" python3 "$PEER" send "$PORT" "$REPS" "$MANIFEST" torch_bench "$OUT/torch_send.json" 2> "$OUT/torch_send.log" &
SENDER=$!
"${PEER_ENV[@]}" python3 "$PEER" recv "$PORT" "$REPS" "$MANIFEST" torch_bench "$OUT/torch_recv.json" 2> "$OUT/torch_recv.log" \
  || { echo "receiver failed:"; tail -30 "$OUT/torch_recv.log"; exit 1; }
wait "$SENDER" || { echo "torch sender failed:"; tail -30 "$OUT/torch_send.log"; exit 1; }

# 3. Manta rank 0 -> a Manta rank 1 (Rust, as an engine on a worker receives), the same
# tensors, timed the same way; BALLAST_GIB (if set) first fills that much of each GPU.
rm -f "$MANIFEST"
PORT=$(free_port)
"${MANTA_ENV[@]}" ${BALLAST_GIB:+BALLAST_GIB=$BALLAST_GIB} ./bin/weight_sync_nccl send "$PORT" "$REPS" "$MANIFEST" manta_pair "$SHAPE" \
  > "$OUT/pair_send.json" 2> "$OUT/pair_send.log" &
SENDER=$!
for _ in $(seq 600); do [ -f "$MANIFEST" ] && break; sleep 0.1; done
"${MANTA_ENV[@]}" ${BALLAST_GIB:+BALLAST_GIB=$BALLAST_GIB} ./bin/weight_sync_nccl recv "$PORT" "$REPS" "$MANIFEST" manta_pair \
  > "$OUT/manta_pair_recv.json" 2> "$OUT/manta_pair_recv.log" \
  || { echo "Rust receiver failed:"; tail -30 "$OUT/manta_pair_recv.log"; exit 1; }
wait "$SENDER" || { echo "Manta sender (Rust pair) failed:"; tail -30 "$OUT/pair_send.log"; exit 1; }

python3 - "$OUT" "$SHAPE" "$REPS" "${BALLAST_GIB:-0}" <<'PY'
import json, sys
out, shape, reps, ballast = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
load = lambda n: json.load(open(f"{out}/{n}.json"))
manta, torch_, pair = load("manta_recv"), load("torch_recv"), load("manta_pair_recv")
gbps = lambda r: r["bytes"] / r["median_s"] / 1e9
report = {
    "shape": shape,
    "reps": reps,
    "bytes": manta["bytes"],
    "tensors": manta["tensors"],
    "bit_exact": manta["bit_exact"] and torch_["bit_exact"],
    "manta_to_python": {"median_s": manta["median_s"], "GB_per_s": gbps(manta),
                        "bit_exact": manta["bit_exact"], "seconds": manta["seconds"]},
    "torch_to_python": {"median_s": torch_["median_s"], "GB_per_s": gbps(torch_),
                        "bit_exact": torch_["bit_exact"], "seconds": torch_["seconds"]},
    "manta_to_manta": {"median_s": pair["median_s"], "GB_per_s": gbps(pair),
                       "bit_exact": pair["bit_exact"], "seconds": pair["seconds"],
                       "ballast_gib_each_gpu": ballast},
    "manta_send_side": load("manta_send"),
    "bandwidth_ratio_manta_over_torch": gbps(manta) / gbps(torch_),
}
json.dump(report, open(f"{out}/weight_sync_nccl.json", "w"), indent=1)
print(json.dumps({k: v for k, v in report.items()
                  if k not in ("manta_send_side",)}, indent=1)[:3000])
PY
