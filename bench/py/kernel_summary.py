#!/usr/bin/env python3
"""Where a Kineto trace's GPU time goes: a table of kernels (and copies, memsets) by total
device time, the GPU's busy span, how much of it no kernel ran, and the top CPU ops.

usage: kernel_summary.py TRACE.json [--top N] [--json OUT] [--by-launch | --minus BASE.json [--per N]]

TRACE.json is a Chrome trace from libtorch's profiler (MANTA_TORCH_PROFILE=DIR writes
them, docs/knobs.md; torch.profiler's export_chrome_trace too). Kernels on concurrent
streams overlap, so the idle fraction comes from the union of their intervals, per
device, not from their summed durations. CPU op times are inclusive (aten::linear holds
its aten::mm). Standard library only: it runs on the GPU machine as it is.

--by-launch: kernels grouped by name and launch shape (grid and block, from the trace's
args), with the median and quartiles of their durations: one kernel name that runs
several projections (a GEMV) shows each apart, and a grid of about one wave shows as
the slow one. Take the trace with MANTA_PDL=0 for it: under programmatic dependent
launch a kernel's duration includes its wait for the kernel before.

--minus BASE.json: the kernels of TRACE less those of BASE, by name (time and count), for
a trace that holds BASE's work and more: engine_decode's trace of a prefill and 32 decode
steps minus its trace of the prefill alone is what the 32 steps cost. --per N divides the
difference by N (per decode step).
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


def quantile(sorted_values, q):
    """The value at fraction `q` of a sorted list (nearest rank, no interpolation)."""
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def by_launch(events, width=60):
    """Rows by (name, grid, block), largest total first: count, total ms, and the 25th,
    50th and 75th percentile of the durations in µs."""
    groups = defaultdict(list)
    for e in events:
        a = e.get("args") or {}
        groups[(e["name"], str(a.get("grid", "?")), str(a.get("block", "?")))].append(float(e["dur"]))
    rows = []
    for (name, grid, block), durs in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
        durs.sort()
        rows.append({"name": short(name, width), "grid": grid, "block": block, "count": len(durs),
                     "total_ms": sum(durs) / 1e3, "p25_us": quantile(durs, 0.25),
                     "median_us": quantile(durs, 0.5), "p75_us": quantile(durs, 0.75)})
    return rows


def launch_table(rows, title):
    out = [f"{title:<60} {'grid':>16} {'block':>14} {'count':>7} {'total ms':>10} "
           f"{'p25 µs':>9} {'median µs':>10} {'p75 µs':>9}"]
    for r in rows:
        out.append(f"{r['name']:<60} {r['grid']:>16} {r['block']:>14} {r['count']:>7} "
                   f"{r['total_ms']:>10.3f} {r['p25_us']:>9.1f} {r['median_us']:>10.1f} {r['p75_us']:>9.1f}")
    return "\n".join(out)


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


def kernel_sums(trace):
    """Total µs and count of the trace's GPU events, by full name."""
    total, count = defaultdict(float), defaultdict(int)
    for e in complete_events(trace, GPU_CATS):
        total[e["name"]] += float(e["dur"])
        count[e["name"]] += 1
    return total, count


def difference(trace, base, per=1):
    """Kernel rows of `trace` less `base`'s by full name (total time and count), divided by
    `per`; names whose time does not grow are left out. Largest first."""
    (t1, c1), (t0, c0) = kernel_sums(trace), kernel_sums(base)
    extra = {n: us - t0.get(n, 0.0) for n, us in t1.items()}
    extra = {n: us for n, us in extra.items() if us > 0}
    summed = sum(extra.values())
    rows = []
    for name, us in sorted(extra.items(), key=lambda kv: -kv[1]):
        count = c1[name] - c0.get(name, 0)
        rows.append({
            "name": short(name),
            "total_ms": us / 1e3 / per,
            "count": count / per,
            "mean_us": us / count if count > 0 else float("nan"),
            "percent": 100.0 * us / summed if summed else 0.0,
        })
    return rows


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


def load(path):
    """A trace file as JSON, or exit with what is wrong with it."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f"kernel_summary: cannot read {path}: {e}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("trace", help="Chrome trace JSON (Kineto)")
    p.add_argument("--top", type=int, default=30, help="kernel rows to print (30)")
    p.add_argument("--json", metavar="OUT", help="also write the summary as JSON to OUT")
    p.add_argument("--minus", metavar="BASE", help="subtract BASE's kernels (a trace of part of the work)")
    p.add_argument("--per", type=int, default=1, help="with --minus: divide the difference by N (1)")
    p.add_argument("--by-launch", action="store_true",
                   help="group kernels by name, grid and block, with duration quartiles")
    args = p.parse_args(argv)
    if args.by_launch and args.minus:
        sys.exit("kernel_summary: --by-launch and --minus do not combine")
    if args.per < 1:
        sys.exit(f"kernel_summary: --per must be at least 1, not {args.per}")
    trace = load(args.trace)
    if args.minus:
        rows = difference(trace, load(args.minus), args.per)
        s = {"minus": args.minus, "per": args.per, "kernels": rows[:args.top], "kernel_names": len(rows),
             "summed_ms": sum(r["total_ms"] for r in rows)}
        unit = f" per {args.per}" if args.per > 1 else ""
        print(table(s["kernels"], f"GPU kernels{unit}, less the base trace (top {args.top} of {len(rows)})"))
        print(f"\nsummed{unit}: {s['summed_ms']:.3f} ms")
    elif args.by_launch:
        gpu = list(complete_events(trace, GPU_CATS))
        rows = by_launch(gpu)
        s = {"launches": rows[:args.top], "launch_shapes": len(rows), "gpu": busy(gpu)}
        print(launch_table(s["launches"], f"GPU kernels by launch shape (top {args.top} of {len(rows)})"))
        if s["gpu"] is not None:
            print("\n" + busy_line("GPU", s["gpu"]))
    else:
        s = summarize(trace, args.top)
        print(report(s, args.top))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"trace": args.trace, **s}, f, indent=1)


if __name__ == "__main__":
    main()
