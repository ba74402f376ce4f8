#!/usr/bin/env bash
# Control-plane benchmark: Manta (bench/src/bin/control_plane.rs against fresh `worker`
# processes) and Ray (bench/py/control_plane_ray.py, Ray from PyPI in bench/.venv-ray)
# run the same workload one after the other on this machine. Writes
# bench/results/control_plane.json and prints a table.
#
# usage: bash bench/run_control_plane.sh [RTT_SAMPLES=10000] [SAMPLE_MB=100]
# CONTROL_PLANE_OUT overrides the results path; CONTROL_PLANE_PROFILE=release uses
# release builds (default: the workspace dev profile, opt-level 1 / deps 2).
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-10000}
MB=${2:-100}
PROFILE=${CONTROL_PLANE_PROFILE:-dev}
PY=${MANTA_PYTHON:-.venv/bin/python}
RAY_VENV=bench/.venv-ray
if [ ! -x "$RAY_VENV/bin/python" ] || ! "$RAY_VENV/bin/python" -c 'import ray, numpy' 2>/dev/null; then
  echo "creating $RAY_VENV (ray, numpy from PyPI)" >&2
  python3 -m venv "$RAY_VENV"
  "$RAY_VENV/bin/pip" install -q ray numpy
fi
TL=$("$PY" -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib
export LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-}
# One build of both binaries, with the workspace's features (reuses a `cargo test` build).
PATH=$(pwd)/.venv/bin:$PATH cargo build --profile "$PROFILE" --workspace --bin control_plane --bin worker
DIR=target/$([ "$PROFILE" = dev ] && echo debug || echo "$PROFILE")
WORK=$(mktemp -d)
MANTA_CLUSTER_TOKEN=$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')
export MANTA_CLUSTER_TOKEN

echo "manta: $N round trips, 2 fresh workers, ${MB} MB of samples" >&2
"$DIR/control_plane" "$DIR/worker" "$N" "$MB" >"$WORK/manta.json"
SAMPLES=$("$PY" -c 'import json,sys;print(json.load(open(sys.argv[1]))["samples_sent"])' "$WORK/manta.json")
TOKENS=$("$PY" -c 'import json,sys;print(json.load(open(sys.argv[1]))["sample_tokens"])' "$WORK/manta.json")
echo "ray: $N round trips, ray.init + 2 actors, $SAMPLES samples" >&2
"$RAY_VENV/bin/python" bench/py/control_plane_ray.py "$N" "$SAMPLES" "$TOKENS" >"$WORK/ray.json" 2>"$WORK/ray.log" \
  || { cat "$WORK/ray.log" >&2; exit 1; }

"$PY" - "$WORK" "${CONTROL_PLANE_OUT:-bench/results/control_plane.json}" "$PROFILE" <<'PY'
import json, os, platform, sys
work, out_path, profile = sys.argv[1:4]
m = json.load(open(os.path.join(work, "manta.json")))
# Ray's raylet prints warnings on stdout; the result is the last JSON line.
ray_lines = [l for l in open(os.path.join(work, "ray.json")) if l.startswith("{")]
r = json.loads(ray_lines[-1])
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.machine())
mb = m["samples_wire_bytes"] / 1e6
r["ray_samples_mb_per_s"] = round(mb / r["ray_samples_transfer_s"], 1)
res = {
    "device": f"{platform.node()}: {os.cpu_count()} CPU cores ({cpu}); loopback TCP",
    "date": __import__("datetime").date.today().isoformat(),
    "benchmark": "control plane: actor call round trips, pipelined calls, cluster start, "
                 "bulk samples driver->worker; Manta and Ray run one after the other, same machine",
    "machine": f"{os.cpu_count()} CPU cores ({cpu}), shared with other work; loopback TCP",
    "manta_build": f"cargo profile {profile}",
    # Other work on the machine moves sub-millisecond figures: its load when the run ended.
    "load_average_1m_at_end": round(os.getloadavg()[0], 2),
    **m, **r,
    "definitions": {
        "rtt_*_in_process": "ractor call! to an echo actor in the same process (mailbox + reply port)",
        "ray_local_mode_*": "Ray's only in-process actor call (local_mode); absent where this Ray refuses it (see ray_local_mode_error)",
        "rtt_*_cross_process": "gRPC Echo to a `worker` process, token checked, through the worker's echo actor; one call at a time; over the channel WorkerClient uses (tonic's transport::Channel)",
        "worker_client_echo_rtt_*": "the same through WorkerClient::echo (adds its timeout wrapper)",
        "heartbeat_rtt_*": "gRPC Heartbeat (handled in the daemon, no actor), one at a time",
        "ray_rtt_*": "ray.get(actor.echo.remote(i)) to an actor in another process on this machine, one at a time",
        "pipelined_calls_per_s_cross_process": "Echo calls with 64 in flight over one channel",
        "ray_pipelined_calls_per_s": "all calls submitted, then one ray.get (Ray's best case)",
        "ray_pipelined_calls_per_s_window64": "at most 64 outstanding (ray.wait sliding window), same shape as Manta's",
        "cluster_ready_s": "median over runs: spawn 2 fresh `worker` processes -> both answered Describe (token accepted) and an Echo through their actor",
        "ray_init_s": "median over runs: ray.init() (local cluster, no dashboard)",
        "ray_cluster_ready_s": "median over runs: ray.init() + 2 actors created and answered a call",
        "samples_*": "samples_sent manta.common.Sample messages (protobuf total samples_wire_bytes) client-streamed to the worker, which decodes each; MB = 1e6 bytes",
        "ray_samples_*": "the same samples as dicts of numpy arrays passed to one remote actor method (object store, numpy read zero-copy on the actor); MB/s over the same protobuf MB for comparability",
    },
}
json.dump(res, open(out_path, "w"), indent=2)
rows = [
    ("actor RTT in-process p50/p99 (us)", f"{m['rtt_p50_us_in_process']}/{m['rtt_p99_us_in_process']}",
     f"{r['ray_local_mode_rtt_p50_us']}/{r['ray_local_mode_rtt_p99_us']}" if "ray_local_mode_rtt_p50_us" in r else "n/a (no local_mode)"),
    ("actor RTT cross-process p50/p99 (us)", f"{m['rtt_p50_us_cross_process']}/{m['rtt_p99_us_cross_process']}",
     f"{r['ray_rtt_p50_us']}/{r['ray_rtt_p99_us']}"),
    ("heartbeat RTT p50/p99 (us, no actor)", f"{m['heartbeat_rtt_p50_us_cross_process']}/{m['heartbeat_rtt_p99_us_cross_process']}", ""),
    ("pipelined calls/s (64 in flight)", f"{m['pipelined_calls_per_s_cross_process']:.0f}",
     f"{r['ray_pipelined_calls_per_s_window64']:.0f} (all at once: {r['ray_pipelined_calls_per_s']:.0f})"),
    ("driver + 2 workers ready (s)", f"{m['cluster_ready_s']}", f"{r['ray_cluster_ready_s']} (ray.init {r['ray_init_s']})"),
    (f"{mb:.0f} MB samples -> worker (MB/s)", f"{m['samples_mb_per_s']}", f"{r['ray_samples_mb_per_s']}"),
]
print(f"{'':<40}{'manta':>22}  ray")
for name, a, b in rows:
    print(f"{name:<40}{a:>22}  {b}")
print(f"targets: cross-process p50 < 100 us: {m['rtt_p50_us_cross_process'] < 100}; "
      f"cluster ready < 1 s: {m['cluster_ready_s'] < 1}")
print(f"machine: {res['machine']}")
PY
