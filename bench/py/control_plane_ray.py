"""Control-plane benchmark, Ray side (bench/src/bin/control_plane.rs is Manta's).

Same workload as the Rust side: actor echo round trips (10k after warm-up), pipelined
echo calls, a local cluster with 2 actors from nothing to ready, and N samples (the
count whose Manta protobuf encoding is SAMPLE_MB) passed to a remote actor method as
numpy arrays. Prints one JSON object.

usage: control_plane_ray.py [RTT_SAMPLES=10000] [NUM_SAMPLES=6000] [SAMPLE_TOKENS=2048]
"""

import json
import statistics
import sys
import time

import numpy as np
import ray

PIPELINED_CALLS = 50_000
IN_FLIGHT = 64
READY_REPEATS = 3
INGEST_REPEATS = 3


@ray.remote(num_cpus=0)
class Echo:
    def echo(self, x):
        return x

    def ingest(self, samples):
        return len(samples), sum(len(s["tokens"]) for s in samples)


def pct(us, q):
    us = sorted(us)
    return us[round((len(us) - 1) * q)]


def init():
    # No dashboard: the cheapest local start Ray offers (favours Ray).
    ray.init(include_dashboard=False, log_to_driver=False, logging_level="ERROR")


def cluster_ready():
    """Seconds from nothing to ray.init() done, and to 2 actors answering."""
    t0 = time.perf_counter()
    init()
    t_init = time.perf_counter() - t0
    actors = [Echo.remote(), Echo.remote()]
    ray.get([a.echo.remote(0) for a in actors])
    return t_init, time.perf_counter() - t0, actors


def make_samples(n, tokens):
    rng = np.random.default_rng(0)
    prompt = tokens // 4
    mask = (np.arange(tokens) >= prompt).astype(np.uint32)
    return [
        {
            "id": i, "group_index": i // 8, "index": i % 8,
            "tokens": rng.integers(0, 151_936, tokens, dtype=np.uint32),
            "response_length": tokens - prompt,
            "loss_mask": mask.copy(),
            "rollout_log_probs": -rng.random(tokens, dtype=np.float32) * 10,
            "reward": float(i % 2), "status": 0, "weight_version": 1,
            "metadata": {"environment": "bench/Env", "task_hash": f"{i:016x}", "stop_reason": "stop"},
        }
        for i in range(n)
    ]


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000
    num_samples = int(sys.argv[2]) if len(sys.argv) > 2 else 6000
    sample_tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 2048
    warm = max(n // 10, 100)
    out = {"ray_version": ray.__version__}

    inits, readies = [], []
    for i in range(READY_REPEATS):
        t_init, t_ready, actors = cluster_ready()
        inits.append(t_init)
        readies.append(t_ready)
        if i < READY_REPEATS - 1:
            ray.shutdown()
    out["ray_init_s"] = round(statistics.median(inits), 4)
    out["ray_cluster_ready_s"] = round(statistics.median(readies), 4)
    out["ray_init_runs_s"] = [round(x, 4) for x in inits]
    out["ray_cluster_ready_runs_s"] = [round(x, 4) for x in readies]

    a = actors[0]
    for i in range(warm):
        ray.get(a.echo.remote(i))
    us = []
    for i in range(n):
        t = time.perf_counter()
        r = ray.get(a.echo.remote(i))
        us.append((time.perf_counter() - t) * 1e6)
        assert r == i
    out["ray_rtt_p50_us"] = round(pct(us, 0.5), 1)
    out["ray_rtt_p99_us"] = round(pct(us, 0.99), 1)
    out["ray_rtt_mean_us"] = round(statistics.fmean(us), 1)

    # Pipelined, Ray's best case: submit everything, then one ray.get.
    t = time.perf_counter()
    ray.get([a.echo.remote(i) for i in range(PIPELINED_CALLS)])
    out["ray_pipelined_calls_per_s"] = round(PIPELINED_CALLS / (time.perf_counter() - t))
    # Same shape as Manta's: at most IN_FLIGHT outstanding (sliding window).
    t = time.perf_counter()
    pending = []
    for i in range(PIPELINED_CALLS):
        if len(pending) >= IN_FLIGHT:
            _, pending = ray.wait(pending, num_returns=1)
        pending.append(a.echo.remote(i))
    ray.get(pending)
    out["ray_pipelined_calls_per_s_window64"] = round(PIPELINED_CALLS / (time.perf_counter() - t))

    samples = make_samples(num_samples, sample_tokens)
    raw = sum(s["tokens"].nbytes + s["loss_mask"].nbytes + s["rollout_log_probs"].nbytes for s in samples)
    secs = []
    for _ in range(INGEST_REPEATS):
        t = time.perf_counter()
        got, toks = ray.get(a.ingest.remote(samples))
        secs.append(time.perf_counter() - t)
        assert got == num_samples and toks == num_samples * sample_tokens, (got, toks)
    out["ray_samples_transfer_s"] = round(statistics.median(secs), 4)
    out["ray_samples_transfer_runs_s"] = [round(x, 4) for x in secs]
    out["ray_samples_array_bytes"] = raw
    out["ray_samples_per_s"] = round(num_samples / statistics.median(secs))
    ray.shutdown()

    # Ray has no in-process actor call; local_mode (deprecated) runs actor methods in
    # the driver process, the nearest thing.
    try:
        ray.init(local_mode=True, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
        la = Echo.remote()
        for i in range(warm):
            ray.get(la.echo.remote(i))
        us = []
        for i in range(n):
            t = time.perf_counter()
            ray.get(la.echo.remote(i))
            us.append((time.perf_counter() - t) * 1e6)
        out["ray_local_mode_rtt_p50_us"] = round(pct(us, 0.5), 2)
        out["ray_local_mode_rtt_p99_us"] = round(pct(us, 0.99), 2)
        ray.shutdown()
    except Exception as e:  # noqa: BLE001 - reported, not hidden
        out["ray_local_mode_error"] = f"{type(e).__name__}: {e}"
    print(json.dumps(out))


if __name__ == "__main__":
    main()
