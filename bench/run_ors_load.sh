#!/usr/bin/env bash
# ORS load benchmark: Manta's ORS client (target/release/ors_load) and the official
# `openreward` Python SDK client run the same scripted episodes, one after the other,
# against the same local SDK Server (bench/py/ors_load_env.py). Writes
# bench/results/ors_load.json and prints a table.
#
# usage: bash bench/run_ors_load.sh [EPISODES=1000] [CONCURRENCY=200]
# ORS_LOAD_OUT overrides the results path.
# Build first: cargo build --release -p manta-bench --bin ors_load
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${MANTA_PYTHON:-.venv/bin/python}
BIN=${ORS_LOAD_BIN:-target/release/ors_load}
EPISODES=${1:-1000}
CONC=${2:-200}
VARIANT=orsloadenv
export OPENREWARD_DISABLE_UPDATE_CHECK=1
TL=$("$PY" -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib
export LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-}
WORK=$(mktemp -d)
PORT=$("$PY" -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])')
URL=http://127.0.0.1:$PORT

"$PY" bench/py/ors_load_env.py 127.0.0.1 "$PORT" >"$WORK/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 100); do
  curl -sf "$URL/health" >/dev/null && break
  kill -0 $SERVER || { cat "$WORK/server.log"; exit 1; }
  sleep 0.2
done

echo "rust client: $EPISODES episodes, $CONC concurrent -> $URL" >&2
"$BIN" "$URL" "$VARIANT" "$EPISODES" "$CONC" >"$WORK/rust.json"
curl -sf -X POST "$URL/bench_timings" >"$WORK/rust_server.json"
echo "python SDK client: $EPISODES episodes, $CONC concurrent -> $URL" >&2
"$PY" bench/py/ors_load_sdk_client.py "$URL" "$VARIANT" "$EPISODES" "$CONC" >"$WORK/sdk.json"
curl -sf -X POST "$URL/bench_timings" >"$WORK/sdk_server.json"
echo "rust client vs Manta's built-in server (counter, same process)" >&2
"$BIN" builtin counter "$EPISODES" "$CONC" >"$WORK/builtin.json"

"$PY" - "$WORK" "${ORS_LOAD_OUT:-bench/results/ors_load.json}" <<'PY'
import json, os, platform, sys
import numpy as np
from importlib.metadata import version

work, out_path = sys.argv[1], sys.argv[2]
load = lambda n: json.load(open(os.path.join(work, n)))
# The HTTP requests each client-side ORS call makes, in order (pings are background).
EXPECT = {"open": ["/create_session", "/create"], "tools": ["/task_tools"],
          "prompt": ["/prompt"], "call": ["/call"], "close": ["/delete", "/delete_session"]}

def join(client, server):
    """Per call: client wall ms, summed server handling ms, overhead = wall - server."""
    wall, srv, tool_over, unmatched = [], [], [], 0
    for sid, calls in client["sessions"].items():
        recs = [r for r in server.get(sid, []) if not r[0].endswith("/ping")]
        i = 0
        for op, w in calls:
            s, ok = 0.0, True
            for suffix in EXPECT[op]:
                if i < len(recs) and recs[i][0].endswith(suffix):
                    s += recs[i][1]
                    i += 1
                else:
                    ok = False
            if not ok:
                unmatched += 1
                continue
            wall.append(w); srv.append(s)
            if op == "call":
                tool_over.append(w - s)
    wall, srv = np.array(wall), np.array(srv)
    over = wall - srv
    p = lambda a, q: round(float(np.percentile(a, q)), 3) if len(a) else None
    return {
        "episodes": client["episodes"], "errors": client["errors"],
        "episodes_per_s": round(client["episodes_per_s"], 2), "wall_s": round(client["wall_s"], 3),
        "overhead_p50_ms": p(over, 50), "overhead_p99_ms": p(over, 99),
        "tool_call_overhead_p50_ms": p(tool_over, 50), "tool_call_overhead_p99_ms": p(tool_over, 99),
        "call_wall_p50_ms": p(wall, 50), "call_wall_p99_ms": p(wall, 99),
        "server_p50_ms": p(srv, 50), "server_p99_ms": p(srv, 99),
        "measured_calls": int(len(wall)), "unmatched_calls": unmatched,
        "error_samples": client["error_samples"],
    }

rust = join(load("rust.json"), load("rust_server.json"))
sdk = join(load("sdk.json"), load("sdk_server.json"))
b = load("builtin.json")
bw = np.array([w for calls in b["sessions"].values() for _, w in calls])
builtin = {"builtin_errors": b["errors"], "builtin_episodes_per_s": round(b["episodes_per_s"], 2),
           "builtin_call_wall_p50_ms": round(float(np.percentile(bw, 50)), 3),
           "builtin_call_wall_p99_ms": round(float(np.percentile(bw, 99)), 3)}
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.machine())
res = {
    "device": f"{platform.node()}: {os.cpu_count()} CPU cores; server and clients share them",
    "date": __import__("datetime").date.today().isoformat(),
    "benchmark": "ORS load: scripted episodes (open, tools, prompt, 3 tool calls, close) "
                 "against the local openreward SDK Server, same workload for both clients",
    "machine": f"{os.cpu_count()} CPU cores ({cpu}); server and client share them",
    "server": f"openreward {version('openreward')} SDK Server (uvicorn, one process), "
              "bench/py/ors_load_env.py",
    "concurrency": load("rust.json")["concurrency"],
    "calls_per_episode": 7,
    "overhead_definition": "per ORS call: client wall time minus the server's handling time of the "
                           "HTTP requests that call made (ASGI entry to last body chunk handed to "
                           "uvicorn, summed); it includes loopback TCP, uvicorn parsing and any wait "
                           "for the server's event loop before the request reaches the app",
    **rust,
    **{f"sdk_{k}": v for k, v in sdk.items()},
    **builtin,
    "builtin_note": "Manta client against manta-envs' built-in counter server in the same "
                    "process (no Python server); no server timings, so call wall time only",
    "baseline": "openreward Python SDK AsyncOpenReward client (asyncio + semaphore)",
}
json.dump(res, open(out_path, "w"), indent=2)
print(f"{'client':<34}{'errors':>7}{'ep/s':>9}{'ovh p50':>10}{'ovh p99':>10}{'call p50':>10}{'call p99':>10}  (ms)")
for name, r in [("manta OrsClient (Rust)", rust), ("openreward SDK client (Python)", sdk)]:
    print(f"{name:<34}{r['errors']:>7}{r['episodes_per_s']:>9.1f}{r['overhead_p50_ms']:>10.2f}"
          f"{r['overhead_p99_ms']:>10.2f}{r['call_wall_p50_ms']:>10.2f}{r['call_wall_p99_ms']:>10.2f}")
print(f"{'manta OrsClient vs built-in server':<34}{b['errors']:>7}{b['episodes_per_s']:>9.1f}"
      f"{'-':>10}{'-':>10}{builtin['builtin_call_wall_p50_ms']:>10.2f}{builtin['builtin_call_wall_p99_ms']:>10.2f}")
print(f"machine: {res['machine']}")
for n, r in [("rust", rust), ("sdk", sdk)]:
    if r["error_samples"] or r["unmatched_calls"]:
        print(f"{n}: unmatched calls {r['unmatched_calls']}, errors {r['error_samples']}")
sys.exit(1 if rust["errors"] or b["errors"] else 0)
PY
