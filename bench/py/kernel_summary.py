#!/usr/bin/env python3
"""Where a Kineto trace's GPU time goes: a table of kernels (and copies, memsets) by total
device time, the GPU's busy span, how much of it no kernel ran, and the top CPU ops.

usage: kernel_summary.py TRACE.json [--top N] [--json OUT]

TRACE.json is a Chrome trace from libtorch's profiler (MANTA_TORCH_PROFILE=DIR writes
them, docs/knobs.md; torch.profiler's export_chrome_trace too). Kernels on concurrent
streams overlap, so the idle fraction comes from the union of their intervals, per
device, not from their summed durations. CPU op times are inclusive (aten::linear holds
its aten::mm). Standard library only: it runs on the GPU machine as it is.
"""
import argparse
import json
import sys
from collections import defaultdict

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
NAME_CHARS = 90
CPU_TOP = 25


def short(name, width=NAME_CHARS):
    """A kernel name cut to `width` characters: template arguments make some run to
    thousands, and their head (namespace, kernel, first arguments) tells them apart."""
    return name if len(name) <= width else name[: width - 1] + "…"


def complete_events(trace, cats):
    """The trace's complete ("ph": "X") events whose category is in `cats`."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in cats and "ts" in e and "dur" in e:
            yield e


def union_length(intervals):
    """Total length covered by (start, end) intervals, overlaps counted once."""
    covered, end_so_far, start_run = 0.0, None, None
    for start, end in sorted(intervals):
        if end_so_far is None or start > end_so_far:
            if end_so_far is not None:
                covered += end_so_far - start_run
            start_run, end_so_far = start, end
        else:
            end_so_far = max(end_so_far, end)
    if end_so_far is not None:
        covered += end_so_far - start_run
    return covered


def by_name(events, width=NAME_CHARS):
    """Rows of total ms, count, mean µs and share of the summed time, by name, largest
    total first. Names are grouped in full and shown cut to `width`."""
    total = defaultdict(float)
    count = defaultdict(int)
    for e in events:
        total[e["name"]] += float(e["dur"])
        count[e["name"]] += 1
    summed = sum(total.values())
    rows = []
    for name, us in sorted(total.items(), key=lambda kv: -kv[1]):
        rows.append({
            "name": short(name, width),
            "total_ms": us / 1e3,
            "count": count[name],
            "mean_us": us / count[name],
            "percent": 100.0 * us / summed if summed else 0.0,
        })
    return rows


def device_of(e):
    """The GPU an event ran on: Kineto puts it in args.device, and uses it as the pid."""
    return (e.get("args") or {}).get("device", e.get("pid"))


def busy(events):
    """First start to last end, the summed durations, the union of the intervals and the
    fraction of the span no event covered."""
    intervals = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events]
    if not intervals:
        return None
    first = min(s for s, _ in intervals)
    last = max(e for _, e in intervals)
    span = last - first
    covered = union_length(intervals)
    return {
        "span_ms": span / 1e3,
        "summed_ms": sum(e - s for s, e in intervals) / 1e3,
        "busy_ms": covered / 1e3,
        "idle_fraction": 1.0 - covered / span if span > 0 else 0.0,
    }


def summarize(trace, top):
    gpu = list(complete_events(trace, GPU_CATS))
    devices = defaultdict(list)
    for e in gpu:
        devices[device_of(e)].append(e)
    return {
        "kernels": by_name(gpu)[:top],
        "kernel_names": len({e["name"] for e in gpu}),
        "gpu": busy(gpu),
        "gpu_by_device": {str(d): busy(es) for d, es in sorted(devices.items(), key=str)},
        "cpu_ops": by_name(complete_events(trace, ("cpu_op",)))[:CPU_TOP],
    }


def table(rows, title, percent=True):
    """Rows as text; `percent` off where shares mean nothing (inclusive CPU op times
    count nested ops twice)."""
    pct = f" {'%':>6}" if percent else ""
    out = [f"{title:<{NAME_CHARS}} {'total ms':>10} {'count':>7} {'mean µs':>10}{pct}"]
    for r in rows:
        pct = f" {r['percent']:>6.1f}" if percent else ""
        out.append(f"{r['name']:<{NAME_CHARS}} {r['total_ms']:>10.3f} {r['count']:>7} "
                   f"{r['mean_us']:>10.1f}{pct}")
    return "\n".join(out)


def busy_line(label, b):
    return (f"{label}: span {b['span_ms']:.3f} ms, kernels summed {b['summed_ms']:.3f} ms, "
            f"busy (union) {b['busy_ms']:.3f} ms, idle {100 * b['idle_fraction']:.1f}%")


def report(s, top):
    lines = []
    if s["gpu"] is None:
        lines.append("no GPU kernels in the trace (a CPU profile, or CUDA activities off)")
    else:
        lines.append(table(s["kernels"], f"GPU kernels (top {top} of {s['kernel_names']})"))
        lines.append("")
        lines.append(busy_line("GPU", s["gpu"]))
        if len(s["gpu_by_device"]) > 1:
            for d, b in s["gpu_by_device"].items():
                lines.append(busy_line(f"  device {d}", b))
    lines.append("")
    lines.append(table(s["cpu_ops"], f"CPU ops, inclusive (top {CPU_TOP})", percent=False))
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trace", help="Chrome trace JSON (Kineto)")
    p.add_argument("--top", type=int, default=30, help="kernel rows to print (30)")
    p.add_argument("--json", metavar="OUT", help="also write the summary as JSON to OUT")
    args = p.parse_args(argv)
    try:
        with open(args.trace, encoding="utf-8") as f:
            trace = json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f"kernel_summary: cannot read {args.trace}: {e}")
    s = summarize(trace, args.top)
    print(report(s, args.top))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"trace": args.trace, **s}, f, indent=1)


if __name__ == "__main__":
    main()
