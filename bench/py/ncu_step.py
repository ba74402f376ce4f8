"""Per-kernel GPU time of one engine step, from an Nsight Compute CSV.

Usage: ncu --csv --metrics gpu__time_duration.sum ... > run.csv; python3 ncu_step.py run.csv
Steps end with the sampling kernel `sample_pick`; the report is the last complete decode
step (one with the paged decode attention kernel), grouped by kernel.
"""
import csv
import sys
from collections import OrderedDict


def main(path):
    rows = []
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = r["Metric Unit"]
        v = float(r["Metric Value"].replace(",", ""))
        us = v / 1e3 if unit in ("ns", "nsecond") else v if unit in ("us", "usecond") else v * 1e3
        rows.append((r["Kernel Name"][:70], r["Grid Size"], us))
    ends = [i for i, r in enumerate(rows) if r[0].startswith("sample_pick")]
    if len(ends) < 2:
        sys.exit(f"{path}: fewer than two steps ({len(rows)} kernels)")
    steps = [rows[a + 1 : b + 1] for a, b in zip(ends, ends[1:])]
    # The last decode step: one with the paged decode attention kernel.
    decode = [s for s in steps if any(n.startswith("paged_decode_attention") for n, _, _ in s)]
    step = (decode or steps)[-1]
    groups = OrderedDict()
    for name, grid, us in step:
        g = groups.setdefault((name, grid), [0, 0.0])
        g[0] += 1
        g[1] += us
    total = sum(us for _, _, us in step)
    print(f"{path}: one step, {len(step)} kernels, {total:.1f} us of kernel time")
    for (name, grid), (n, us) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        print(f"{us:9.1f} us {n:4d}x {us / n:7.2f} us  {name}  grid {grid}")


if __name__ == "__main__":
    for p in sys.argv[1:]:
        main(p)
