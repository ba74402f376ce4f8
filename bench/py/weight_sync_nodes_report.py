"""Gathers bench/run_workers.sh runs into bench/results/weight_sync_nodes.json.

usage: weight_sync_nodes_report.py OUT.json DEVICE KEY=DIR... [tdist=weight_sync_nccl.json]

Each KEY=DIR is one `workers_MODE` directory of bench/run_workers.sh. Per run: steps,
median step / sync / pause-to-resume times from its metrics.jsonl (steps after the first),
whether every sync was verified bit for bit (the driver's "weight sync verified" lines),
the broadcast collective's own time and bandwidth as the trainer's worker logged it
(median after the first, which opens NCCL's channels), the engine's receive alone and its
pause-to-resume as
the engine's worker logged it, and for a fault run (fault.txt): when the worker was
killed, the first line that named the loss (driver or worker A), the seconds in between,
and the trained_ids check. `tdist` is bench/run_weight_sync_nccl.sh's JSON of the same
model shape: torch.distributed's broadcast bandwidth, measured on the same machine.
Runs already in OUT.json from earlier calls are kept (each with its device and date).
"""
import datetime
import glob
import json
import os
import re
import statistics
import sys

ANSI = re.compile(r"\x1b\[[0-9;]*m")
STAMP = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+)Z")


def lines(path):
    if not os.path.exists(path):
        return []
    return [ANSI.sub("", l.rstrip("\n")) for l in open(path, errors="replace")]


def stamp(line):
    m = STAMP.match(line)
    if not m:
        return None
    t = datetime.datetime.fromisoformat(m.group(1)[:26]).replace(tzinfo=datetime.timezone.utc)
    return t.timestamp()


def field(line, name):
    m = re.search(rf"\b{name}=([0-9.eE+-]+)", line)
    return float(m.group(1)) if m else None


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def run(d):
    metrics = glob.glob(os.path.join(d, "runs", "*", "metrics.jsonl"))
    rows = [json.loads(l) for l in open(metrics[0])] if metrics else []
    later = rows[1:] or rows
    res = {
        "steps": len(rows),
        "median_step_s": median(r.get("perf/step_time") for r in later),
        "median_update_weights_time_s": median(r.get("perf/update_weights_time") for r in later),
        "median_pause_to_resume_s": median(r.get("perf/pause_to_resume_time") for r in later),
    }
    driver = lines(os.path.join(d, "driver.log"))
    verified = [l for l in driver if "weight sync verified bit for bit" in l]
    res["syncs_verified_bit_for_bit"] = len(verified)
    route = [l for l in driver if "weight sync route" in l]
    if route:
        res["route"] = route[0].split("INFO ")[-1].split("WARN ")[-1][:300]
    wa = lines(os.path.join(d, "worker-a.log"))
    casts = [l for l in wa if "weights broadcast from the trainer's worker" in l]
    if casts:
        res["broadcast_bytes"] = field(casts[0], "bytes")
        res["broadcast_first_s"] = field(casts[0], "seconds")
        res["broadcast_median_s"] = median(field(l, "seconds") for l in casts[1:] or casts)
        res["broadcast_median_GB_per_s"] = median(field(l, "gb_per_s") for l in casts[1:] or casts)
    wb = lines(os.path.join(d, "worker-b.log"))
    recv = [l for l in wb if "weights received into the engine's parameters" in l]
    if recv:  # logged by engines built after the first runs of this report
        res["engine_receive_median_s"] = median(field(l, "seconds") for l in recv[1:] or recv)
        res["engine_receive_median_GB_per_s"] = median(field(l, "gb_per_s") for l in recv[1:] or recv)
        # Both workers share the host's clock: the bytes moved only while both sides were
        # in the collective, from the later start to the earlier end (the root's own
        # figure also counts its wait for the engine to pause and join).
        starts = [l for l in wa if "broadcasting the trainer's weights" in l]
        if casts and len(starts) == len(casts) == len(recv):
            spans = []
            for s0, e0, r in zip(starts, casts, recv):
                r_end, r_secs = stamp(r), field(r, "seconds")
                if None in (stamp(s0), stamp(e0), r_end, r_secs):
                    continue
                spans.append(min(stamp(e0), r_end) - max(stamp(s0), r_end - r_secs))
            later_spans = spans[1:] or spans
            if later_spans:
                res["both_in_collective_median_s"] = median(later_spans)
                res["both_in_collective_median_GB_per_s"] = (
                    res["broadcast_bytes"] / max(median(later_spans), 1e-9) / 1e9)
    pauses = [field(l, "pause_to_resume_s") for l in wb if "weights received by broadcast" in l]
    if pauses:
        res["engine_pause_to_resume_median_s"] = median(pauses[1:] or pauses)
        res["engine_pause_to_resume_max_s"] = max(pauses[1:] or pauses)
    fault = lines(os.path.join(d, "fault.txt"))
    kill = [l for l in fault if "SIGKILL" in l]
    if kill:
        t_kill = float(kill[0].split()[0])
        res["fault"] = {"what": kill[0].split(" ", 1)[1]}
        named = [(stamp(l), "driver: " + l.split("Z ", 1)[-1][:300]) for l in driver
                 if ("WARN" in l or "ERROR" in l) and (stamp(l) or 0) >= t_kill]
        named += [(stamp(l), "worker A: " + l.split("Z ", 1)[-1][:300]) for l in wa
                  if ("WARN" in l or "ERROR" in l) and (stamp(l) or 0) >= t_kill]
        named.sort()
        if named:
            res["fault"]["first_line_naming_it"] = named[0][1]
            res["fault"]["seconds_from_kill_to_that_line"] = named[0][0] - t_kill
        aborted = [l for l in wa if "group aborted" in l and (stamp(l) or 0) >= t_kill]
        if aborted:
            res["fault"]["collective_aborted_after_s"] = stamp(aborted[0]) - t_kill
            res["fault"]["collective_aborted_line"] = aborted[0].split("Z ", 1)[-1][:300]
        started = [stamp(l) for l in wa if "broadcasting the trainer's weights" in l]
        before = [t for t in started if t is not None and t <= t_kill]
        if before:
            res["fault"]["killed_s_after_a_broadcast_started"] = t_kill - max(before)
        ids = [l for l in fault if l.startswith("trained_ids")]
        if ids:
            res["fault"]["trained_ids"] = ids[-1]
    return res


def main():
    out, device = sys.argv[1], sys.argv[2]
    report = {
        "device": device,
        "date": datetime.date.today().isoformat(),
        "benchmark": "bench/run_workers.sh: two worker daemons on one host, each its own "
                     "working directory and GPU; the trainer on worker A, a native engine on worker B",
        "runs": {},
    }
    # Runs of earlier calls stay (each says its device and date); the ones named here
    # are replaced.
    if os.path.exists(out):
        old = json.load(open(out))
        for key, r in old.get("runs", {}).items():
            r.setdefault("device", old.get("device"))
            r.setdefault("date", old.get("date"))
            report["runs"][key] = r
        for key, v in old.items():
            if key.endswith("_over_torch_distributed_bandwidth") or key == "torch_distributed_broadcast":
                report[key] = v
    tdist = None
    for arg in sys.argv[3:]:
        key, path = arg.split("=", 1)
        if key == "tdist":
            tdist = json.load(open(path))
        else:
            report["runs"][key] = dict(run(path), device=device, date=report["date"])
    if tdist:
        report["torch_distributed_broadcast"] = {
            "shape": tdist.get("shape"),
            "GB_per_s": tdist["torch_to_python"]["GB_per_s"],
            "median_s": tdist["torch_to_python"]["median_s"],
        }
        for key, r in report["runs"].items():
            if r.get("broadcast_bytes") == tdist.get("bytes") and r.get("broadcast_median_GB_per_s"):
                report[f"{key}_over_torch_distributed_bandwidth"] = (
                    r["broadcast_median_GB_per_s"] / tdist["torch_to_python"]["GB_per_s"])
                if r.get("both_in_collective_median_GB_per_s"):
                    report[f"{key}_both_in_collective_over_torch_distributed_bandwidth"] = (
                        r["both_in_collective_median_GB_per_s"] / tdist["torch_to_python"]["GB_per_s"])
    json.dump(report, open(out, "w"), indent=1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
