"""Summarises bench/run_e2e.sh runs: where each step's time went.

usage: e2e_report.py OUT MODE [MODE...]

Reads OUT/runs/MODE/metrics.jsonl, writes OUT/e2e_MODE.json over the steps after the
first (whose time includes CUDA start-up): the split of the median step, step_s =
rollout_s + train_s + sync_s + other_s, where rollout_s is the time the step waited for
its rollouts (perf/rollout_time) — one step's parts, so they add up, where medians taken
column by column need not — and medians of the rates; prints a table of all modes last.
"""
import datetime
import json
import os
import statistics
import sys


def median(rows, key):
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def summarise(out, mode, device):
    path = os.path.join(out, "runs", mode, "metrics.jsonl")
    rows = [json.loads(l) for l in open(path) if l.strip()]
    steady = rows[1:] if len(rows) > 1 else rows
    timed = sorted((r for r in steady if r.get("perf/step_time") is not None),
                   key=lambda r: r["perf/step_time"])
    mid = timed[(len(timed) - 1) // 2]
    step = mid["perf/step_time"]
    rollout = mid.get("perf/rollout_time") or 0.0
    train = mid.get("perf/train_time") or 0.0
    sync = mid.get("perf/update_weights_time") or 0.0
    res = {
        "device": device,
        "date": datetime.date.today().isoformat(),
        "mode": mode,
        "steps": len(rows),
        "median_step": mid.get("step"),
        "step_s": step,
        "rollout_s": rollout,
        "train_s": train,
        "sync_s": sync,
        "other_s": step - rollout - train - sync,
        "wait_time_ratio": median(steady, "perf/wait_time_ratio"),
        "rollout_tokens_per_s": median(steady, "perf/rollout_tokens_per_sec"),
        "train_tokens_per_s": median(steady, "perf/tokens_per_gpu_per_sec"),
        "train_rollout_logprob_abs_diff": median(steady, "train/train_rollout_logprob_abs_diff"),
        "weight_staleness_max": max((r.get("rollout/weight_staleness/max") or 0 for r in rows), default=0),
        "failed_episodes": sum(r.get("rollout/failed_count") or 0 for r in rows),
        "engine_restarts": sum(r.get("rollout/engine_restarts") or 0 for r in rows),
        "prefix_cache_hit_rate_first_turn": median(steady, "rollout/prefix_cache_hit_rate/first_turn"),
        "prefix_cache_hit_rate_later_turns": median(steady, "rollout/prefix_cache_hit_rate/later_turns"),
        "num_turns_mean": median(steady, "rollout/num_turns/mean"),
    }
    # Learning: mean reward of the last 10 steps minus the first 10 (the learn-* modes).
    rewards = [r["rollout/raw_reward"] for r in rows if r.get("rollout/raw_reward") is not None]
    if len(rewards) >= 20:
        first, last = statistics.mean(rewards[:10]), statistics.mean(rewards[-10:])
        res.update(reward_first10=first, reward_last10=last, reward_gain=last - first)
    json.dump(res, open(os.path.join(out, f"e2e_{mode}.json"), "w"), indent=2)
    return res


def four_gpu_summary(out, four, device):
    """The four-GPU layout's figures (trainer DP2 on GPUs 0-1, engines on GPUs 2-3)
    beside its baselines from the same call: OUT/e2e_4gpu.json."""
    sync = four["dp2-disagg"]
    asyn, one = four.get("dp2-disagg-async"), four.get("dp2-disagg-1engine")
    r2, r1 = four.get("rollout-2engines"), four.get("rollout-1engine")
    ratio = lambda a, b: None if a is None or b in (None, 0) else a / b
    res = {
        "device": device,
        "date": datetime.date.today().isoformat(),
        "model_shape": os.environ.get("MODEL_SHAPE", "0.6b"),
        "layout": "trainer DP2 (ZeRO-2, NCCL) on GPUs 0-1; native engines on GPUs 2 and 3",
        "sync": sync,
        "async": asyn,
        "one_engine": one,
        "sync_share_of_step": ratio(sync["sync_s"], sync["step_s"]),
        "async_over_sync_step": ratio(asyn and asyn["step_s"], sync["step_s"]),
        "rollout_2_engines_over_1_in_loop": ratio(sync["rollout_tokens_per_s"], one and one["rollout_tokens_per_s"]),
        "rollout_only_2_engines": r2,
        "rollout_only_1_engine": r1,
        "rollout_2_engines_over_1": ratio(r2 and r2["rollout_tokens_per_s"], r1 and r1["rollout_tokens_per_s"]),
        "prefix_cache_hit_rate_later_turns": sync["prefix_cache_hit_rate_later_turns"],
        "failed_episodes": sum(r["failed_episodes"] for r in four.values()),
    }
    json.dump(res, open(os.path.join(out, "e2e_4gpu.json"), "w"), indent=2)
    f = lambda v: "-" if v is None else f"{v:.3f}"
    return (f"four GPUs: sync share {f(res['sync_share_of_step'])} (target < 0.01), async/sync "
            f"{f(res['async_over_sync_step'])} (target <= 0.6), rollout 2 engines / 1 "
            f"{f(res['rollout_2_engines_over_1'])} (target >= 1.8), later-turn prefix hit rate "
            f"{f(res['prefix_cache_hit_rate_later_turns'])}")


def main():
    out, modes = sys.argv[1], sys.argv[2:]
    gpu = open(os.path.join(out, "gpu.txt")).read().strip().replace("\n", "; ") \
        if os.path.exists(os.path.join(out, "gpu.txt")) else "unknown GPU"
    device = os.environ.get("MANTA_DEVICE_KIND", "device machine") + ": " + gpu
    results = [summarise(out, m, device) for m in modes if
               os.path.exists(os.path.join(out, "runs", m, "metrics.jsonl"))]
    lines = ["| mode | steps | step s | rollout | train | sync | other | wait ratio | rollout tok/s | train tok/s | logprob diff | failed | reward first10 -> last10 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        pct = lambda k: f"{r[k]:.2f} ({100 * r[k] / r['step_s']:.1f} %)"
        f = lambda v, fmt: "-" if v is None else format(v, fmt)
        gain = (f"{r['reward_first10']:.3f} -> {r['reward_last10']:.3f}" if "reward_gain" in r else "-")
        lines.append(f"| {r['mode']} | {r['steps']} | {r['step_s']:.2f} | {pct('rollout_s')} | {pct('train_s')} | "
                     f"{pct('sync_s')} | {pct('other_s')} | {f(r['wait_time_ratio'], '.3f')} | "
                     f"{f(r['rollout_tokens_per_s'], ',.0f')} | {f(r['train_tokens_per_s'], ',.0f')} | "
                     f"{f(r['train_rollout_logprob_abs_diff'], '.2e')} | {r['failed_episodes']:.0f} | {gain} |")
    sync = next((r for r in results if r["mode"] == "disagg-sync"), None)
    asyn = next((r for r in results if r["mode"] == "disagg-async"), None)
    if sync and asyn:
        lines.append(f"\nasync step time / sync step time = {asyn['step_s'] / sync['step_s']:.2f} (target <= 0.6)")
    four = {r["mode"]: r for r in results if r["mode"].startswith(("dp2-disagg", "rollout-"))}
    if "dp2-disagg" in four and os.environ.get("E2E_4GPU_SUMMARY", "1") == "1":
        lines.append("\n" + four_gpu_summary(out, four, device))
    report = "\n".join(lines)
    open(os.path.join(out, "report.md"), "w").write(f"# e2e, {device}\n\n{report}\n")
    print(report)


if __name__ == "__main__":
    main()
