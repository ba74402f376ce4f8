"""Native engine vs SGLang: the report of bench/run_peers.sh.

usage: peers_report.py OUT [MORE_OUT ...]

Reads, in each directory (the first one found wins per side, shape and batch, so the
results of several device calls merge; peers.json and peers.md are written into OUT):
  gpu.txt               nvidia-smi --query-gpu=name,memory.total (one line per GPU)
  peers_meta.json       the run's settings (run_peers.sh writes it)
  peers_runs.tsv        one line per run: side, shape, exit status (or "budget"), seconds, limit
  native_<k>.json       bin/engine_decode's stdout: {"shape", "prompt", "new_tokens",
                        "results": [{"batch", "tokens", "wall_s", "tokens_per_s",
                        "prefill_s", "decode_tokens_per_s", "bound_tokens_per_s", ...}]}
  native_<k>.log        its stderr
  sglang_<k>.jsonl      sglang.bench_one_batch --result-filename: one record per
                        (batch, input, output) run: run_name, batch_size, input_len,
                        output_len, prefill_latency, prefill_throughput,
                        median_decode_latency, median_decode_throughput, total_latency
                        (prefill + the output_len-1 decode steps), overall_throughput;
                        the last record of a batch size is the one used
  sglang_<k>.log        its stdout and stderr
  rollout_native/e2e_disagg-sync.json, rollout_sglang/e2e_sglang-disagg.json
                        bench/run_e2e.sh's summaries (made here from runs/MODE/metrics.jsonl
                        by e2e_report.py's summarise() when the run was cut before its report)
(<k> is the shape with "." written "_": 0_6b, 8b.)
Each row with a measured copy bandwidth also gets bench/py/roofline.py's floor.

Definitions, per shape and batch B with NEW new tokens, the same on both sides:
  prefill_s = prefill of the B prompts and the first token;
  decode tokens/s = B*(NEW-1) / (run time - prefill_s);
  e2e tokens/s = B*NEW / run time (prefill + decode);
  native_over_sglang_{decode,e2e}_<k>_b<B> = native / sglang tokens/s,
  native_over_sglang_prefill_<k>_b<B> = sglang prefill_s / native prefill_s (> 1: Manta faster).
"""
import datetime
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import roofline  # noqa: E402  (this folder's module)
DEFINITIONS = {
    "prefill_s": "prefill of the B prompts plus the first token. native: median of 3 runs of B "
                 "requests with max_new_tokens 1 (engine_decode prefill_s); sglang: prefill_latency "
                 "of bench_one_batch (one extend forward of the whole batch + sample, synchronised)",
    "decode_tokens_per_s": "B*(NEW-1) / (run time - prefill_s). native: engine_decode "
                           "decode_tokens_per_s = B*(NEW-1)/(wall_s - prefill_s); sglang: "
                           "B*(output_len-1)/(total_latency - prefill_latency), the mean over its "
                           "decode steps (median_decode_throughput kept apart)",
    "e2e_tokens_per_s": "B*NEW / run time, prefill included. native: tokens/wall_s "
                        "(engine_decode tokens_per_s); sglang: B*output_len/total_latency "
                        "(its overall_throughput also counts prompt tokens: kept apart, not compared)",
    "ratios": "native_over_sglang_decode/e2e = native tokens/s over sglang tokens/s; "
              "native_over_sglang_prefill = sglang prefill_s over native prefill_s; > 1: Manta faster",
    "rollout": "rollout_step_native_over_sglang = sglang rollout_s / native rollout_s (the median "
               "step's time waiting for rollouts, bench/run_e2e.sh disagg-sync vs sglang-disagg); "
               "rollout_tokens_per_s_native_over_sglang = native / sglang median rollout tokens/s",
}


def key_of(shape):
    return shape.replace(".", "_")


def load_json(path):
    """A JSON file, or the last line of it that parses as a JSON object (a binary's stdout
    may carry other lines); None when absent or unparsable."""
    if not os.path.exists(path):
        return None
    text = open(path, errors="replace").read()
    try:
        return json.loads(text)
    except ValueError:
        pass
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def log_tail(path, n=3, width=240):
    if not os.path.exists(path):
        return ""
    lines = [l.strip() for l in open(path, errors="replace").read().splitlines() if l.strip()]
    return " | ".join(l[:width] for l in lines[-n:])


def read_runs(out):
    runs = {}
    path = os.path.join(out, "peers_runs.tsv")
    if os.path.exists(path):
        for line in open(path):
            parts = line.rstrip("\n").split("\t")
            if len(parts) >= 5:
                side, shape, rc, secs, limit = parts[:5]
                runs[(side, shape)] = {"rc": rc, "seconds": _num(secs), "limit_s": _num(limit)}
    return runs


def _num(s):
    try:
        return int(s)
    except ValueError:
        try:
            return float(s)
        except ValueError:
            return s


def describe_run(run):
    rc = run["rc"]
    if rc == "0":
        return None
    if rc == "budget":
        return f"not run: {run['limit_s']} s of BUDGET_S left"
    if not rc.lstrip("-").isdigit():
        return rc
    if rc == "124":
        return f"timed out after {run['limit_s']} s"
    if rc == "137":
        return f"killed (SIGKILL: timeout's -k after {run['limit_s']} s, or out of memory)"
    return f"exit {rc}"


def ratio(a, b):
    return a / b if a and b else None


def native_side(out, shape, runs, new_tokens):
    """{batch: figures} and an error string (None when the run went through)."""
    k = key_of(shape)
    run = runs.get(("native", shape))
    err = describe_run(run) if run else None
    doc = load_json(os.path.join(out, f"native_{k}.json"))
    if not doc or "results" not in doc:
        if run is None and not os.path.exists(os.path.join(out, f"native_{k}.log")):
            return {}, None, None
        tail = "" if run and run["rc"] == "budget" else log_tail(os.path.join(out, f"native_{k}.log"))
        return {}, (err or "no JSON on engine_decode's stdout") + (f"; log: {tail}" if tail else ""), None
    new = doc.get("new_tokens", new_tokens)
    rows = {}
    for r in doc["results"]:
        b = int(r["batch"])
        rows[b] = {
            "native_decode_tokens_per_s": r.get("decode_tokens_per_s"),
            "native_e2e_tokens_per_s": r.get("tokens_per_s"),
            "native_prefill_s": r.get("prefill_s"),
            "native_wall_s": r.get("wall_s"),
            "native_tokens": r.get("tokens"),
            "native_prefill_runs_s": r.get("prefill_runs_s"),
            "bound_tokens_per_s": r.get("bound_tokens_per_s"),
        }
        if r.get("tokens") is not None and r["tokens"] != b * new:
            rows[b]["native_note"] = f"{r['tokens']} tokens, not B*NEW = {b * new}"
    meta = {"prompt": doc.get("prompt"), "new_tokens": new, "load_s": doc.get("load_s"),
            "copy_bandwidth_gb_s": (doc.get("copy_bandwidth_bytes_per_s") or 0) / 1e9 or None}
    return rows, err, meta


def sglang_side(out, shape, runs):
    k = key_of(shape)
    run = runs.get(("sglang", shape))
    err = describe_run(run) if run else None
    path = os.path.join(out, f"sglang_{k}.jsonl")
    log = os.path.join(out, f"sglang_{k}.log")
    recs = []
    if os.path.exists(path):
        for line in open(path):
            line = line.strip()
            if line:
                try:
                    recs.append(json.loads(line))
                except ValueError:
                    pass
    if not recs:
        if run is None and not os.path.exists(log):
            return {}, None, None
        tail = "" if run and run["rc"] == "budget" else log_tail(log)
        return {}, (err or "no record in bench_one_batch's result file") + (f"; log: {tail}" if tail else ""), None
    passes = {}
    rows = {}
    for rec in recs:  # the last record of a batch size wins (the earlier ones warm it)
        b = int(rec["batch_size"])
        passes[b] = passes.get(b, 0) + 1
        ol, il = int(rec["output_len"]), int(rec["input_len"])
        total, pre = rec.get("total_latency"), rec.get("prefill_latency")
        decode_s = total - pre if total is not None and pre is not None else None
        rows[b] = {
            "sglang_decode_tokens_per_s": b * (ol - 1) / decode_s if decode_s and ol > 1 else None,
            "sglang_e2e_tokens_per_s": b * ol / total if total else None,
            "sglang_prefill_s": pre,
            "sglang_total_s": total,
            "sglang_median_decode_tokens_per_s": rec.get("median_decode_throughput"),
            "sglang_median_decode_latency_s": rec.get("median_decode_latency"),
            "sglang_overall_throughput": rec.get("overall_throughput"),
            "sglang_prefill_throughput": rec.get("prefill_throughput"),
            "sglang_input_len": il,
            "sglang_output_len": ol,
        }
    for b in rows:
        rows[b]["sglang_passes"] = passes[b]
    skipped = set()
    if os.path.exists(log):
        for line in open(log, errors="replace"):
            if line.startswith("skipping ("):
                try:
                    skipped.add(int(line[len("skipping ("):].split(",")[0]))
                except ValueError:
                    pass
    return rows, err, {"skipped_batches": sorted(skipped), "run_name": recs[-1].get("run_name")}


def rollout_summary(out, side, mode):
    """e2e_<mode>.json of bench/run_e2e.sh, made from metrics.jsonl if the run was cut."""
    for d in (os.path.join(out, f"rollout_{side}"), out):
        path = os.path.join(d, f"e2e_{mode}.json")
        doc = load_json(path)
        if doc:
            return doc, path
        metrics = os.path.join(d, "runs", mode, "metrics.jsonl")
        if os.path.exists(metrics) and os.path.getsize(metrics) > 0:
            try:
                sys.path.insert(0, HERE)
                from e2e_report import summarise  # noqa: E402
                gpu = os.path.join(d, "gpu.txt")
                device = open(gpu).read().strip().replace("\n", "; ") if os.path.exists(gpu) else "?"
                return summarise(d, mode, device), metrics
            except Exception as e:  # a cut run's partial file
                return {"error": f"{metrics}: {e}"}, metrics
    return None, None


def fmt(x, spec=",.0f"):
    return "-" if x is None else format(x, spec)


def main():
    dirs = sys.argv[1:]
    if not dirs:
        sys.exit("usage: peers_report.py OUT [MORE_OUT ...]")
    out = dirs[0]
    metas = [load_json(os.path.join(d, "peers_meta.json")) or {} for d in dirs]
    meta = metas[0]
    gpus = [open(os.path.join(d, "gpu.txt")).read().strip() if os.path.exists(os.path.join(d, "gpu.txt")) else ""
            for d in dirs]
    warnings = []
    names = [g.splitlines()[0].split(",")[0].strip() if g else "" for g in gpus]
    if len({n for n in names if n}) > 1:
        warnings.append(f"the directories come from different GPUs ({', '.join(names)}): "
                        "compare only rows measured on one device")
    kind = meta.get("device_kind") or os.environ.get("MANTA_DEVICE_KIND", "")
    gpu_names = "; ".join(l.split(",")[0].strip() for l in gpus[0].splitlines()) if gpus[0] else "unknown"
    prompt = meta.get("prompt", 512)
    new = meta.get("new_tokens", 256)

    shapes, batches = [], []
    for m in metas:
        shapes += [s for s in m.get("shapes", []) if s not in shapes]
        batches += [b for b in m.get("batches", []) if b not in batches]
    for d in dirs:  # result files of shapes no meta names
        for f in sorted(os.listdir(d)):
            for pre in ("native_", "sglang_"):
                if f.startswith(pre) and f.endswith((".json", ".jsonl")) and f != "peers_meta.json":
                    s = f[len(pre):].split(".")[0].replace("_", ".")
                    if s not in shapes:
                        shapes.append(s)

    res = {
        "benchmark": f"native engine (bin/engine_decode) vs SGLang (sglang.bench_one_batch, "
                     f"--load-format dummy, flashinfer): random bf16 Qwen3 shapes, B requests of a "
                     f"{prompt}-token prompt and {new} greedy new tokens",
        "device": f"{kind}: {gpu_names}" if kind else gpu_names,
        "gpu": gpus[0],
        "date": datetime.date.today().isoformat(),
        "command": meta.get("command", "bash bench/run_peers.sh"),
        "manta_commit": meta.get("manta_commit"),
        "sglang_versions": meta.get("sglang_versions"),
        "sglang_args": meta.get("sglang_args"),
        "manta_knobs": meta.get("manta_knobs"),
        "prompt": prompt,
        "new_tokens": new,
        "definitions": DEFINITIONS,
        "sources": dirs,
        "rows": [],
    }
    if len(dirs) > 1:
        res["commands"] = [m.get("command") for m in metas]
    runs_all = [read_runs(d) for d in dirs]
    res["runs"] = [{"dir": d, "side": s, "shape": sh, **r}
                   for d, runs in zip(dirs, runs_all) for (s, sh), r in runs.items()]

    flat = {}
    for shape in shapes:
        k = key_of(shape)
        nat, sg = {}, {}
        nat_err = sg_err = None
        nat_meta = sg_meta = None
        for d, runs in zip(dirs, runs_all):
            rows, err, m = native_side(d, shape, runs, new)
            for b, r in rows.items():
                nat.setdefault(b, r)
            if err and nat_err is None:
                nat_err = err
            nat_meta = nat_meta or m
            rows, err, m = sglang_side(d, shape, runs)
            for b, r in rows.items():
                sg.setdefault(b, r)
            if err and sg_err is None:
                sg_err = err
            if m:
                sg_meta = sg_meta or {"skipped_batches": []}
                sg_meta["skipped_batches"] = sorted(set(sg_meta["skipped_batches"]) | set(m["skipped_batches"]))
        if nat_meta:
            res[f"native_load_s_{k}"] = nat_meta.get("load_s")
            res[f"copy_bandwidth_gb_s_{k}"] = nat_meta.get("copy_bandwidth_gb_s")
        shape_batches = list(batches) + sorted(b for b in set(nat) | set(sg) if b not in batches)
        for b in shape_batches:
            n, s = nat.get(b, {}), sg.get(b, {})
            row = {"shape": shape, "batch": b, **n, **s}
            row["native_over_sglang_decode"] = ratio(n.get("native_decode_tokens_per_s"),
                                                     s.get("sglang_decode_tokens_per_s"))
            row["native_over_sglang_e2e"] = ratio(n.get("native_e2e_tokens_per_s"),
                                                  s.get("sglang_e2e_tokens_per_s"))
            row["native_over_sglang_prefill"] = ratio(s.get("sglang_prefill_s"), n.get("native_prefill_s"))
            if n.get("bound_tokens_per_s") and s.get("sglang_decode_tokens_per_s"):
                row["native_decode_bound_fraction"] = (n.get("native_decode_tokens_per_s") or 0) / n["bound_tokens_per_s"]
                row["sglang_decode_bound_fraction"] = s["sglang_decode_tokens_per_s"] / n["bound_tokens_per_s"]
            errors = {}
            if not n:
                errors["native"] = nat_err or ("not run" if nat_meta is None else f"no result for batch {b}")
            if not s:
                if sg_meta and b in sg_meta["skipped_batches"]:
                    errors["sglang"] = ("bench_one_batch skipped it: B*(input+output) exceeds its KV pool "
                                        "(raise SGLANG_MEM_FRACTION)")
                else:
                    errors["sglang"] = sg_err or ("not run" if sg_meta is None else f"no result for batch {b}")
            if s and (s.get("sglang_input_len") != prompt or s.get("sglang_output_len") != new):
                errors["sglang_shape"] = (f"record is input {s.get('sglang_input_len')}, output "
                                          f"{s.get('sglang_output_len')}; expected {prompt}, {new}")
            if errors:
                row["errors"] = errors
            res["rows"].append(row)
            for what in ("decode", "e2e", "prefill"):
                if row[f"native_over_sglang_{what}"] is not None:
                    flat[f"native_over_sglang_{what}_{k}_b{b}"] = row[f"native_over_sglang_{what}"]
    res.update(flat)

    # The multi-turn rollout step through each engine (ROLLOUT=1, two GPUs).
    roll = {}
    for side, mode in (("native", "disagg-sync"), ("sglang", "sglang-disagg")):
        for d in dirs:
            doc, path = rollout_summary(d, side, mode)
            if doc:
                roll[side] = {"mode": mode, "file": path,
                              **{f: doc.get(f) for f in ("rollout_s", "rollout_tokens_per_s", "step_s", "train_s",
                                                         "sync_s", "steps", "engine_restarts", "failed_episodes",
                                                         "device", "error") if f in doc}}
                break
    roll_errors = [f"{r['side']} {r['shape']}: {describe_run(r)}" for r in res["runs"]
                   if r["side"].startswith("rollout") and describe_run(r)]
    if roll_errors:
        res["rollout_errors"] = roll_errors
        warnings += [f"rollout: {e}" for e in roll_errors]
    if roll:
        res["rollout"] = roll
        nat, sg = roll.get("native", {}), roll.get("sglang", {})
        for side, mode in (("native", "disagg-sync"), ("sglang", "sglang-disagg")):
            if side not in roll:
                warnings.append(f"rollout: no e2e_{mode}.json (or runs/{mode}/metrics.jsonl) for the {side} side")
            elif roll[side].get("engine_restarts"):
                warnings.append(f"rollout: the {side} engine restarted {roll[side]['engine_restarts']} times")
        devs = {side: (r.get("device") or "").split(": ", 1)[-1] for side, r in roll.items() if r.get("device")}
        if len(set(devs.values())) > 1:
            warnings.append(f"rollout: the two sides ran on different devices ({devs})")
        res["rollout_step_native_over_sglang"] = ratio(sg.get("rollout_s"), nat.get("rollout_s"))
        res["rollout_tokens_per_s_native_over_sglang"] = ratio(nat.get("rollout_tokens_per_s"),
                                                               sg.get("rollout_tokens_per_s"))
    if warnings:
        res["warnings"] = warnings
    roofline.annotate(res)  # rows with a measured copy bandwidth

    lines = [f"Native engine vs SGLang, {res['device']}, prompt {prompt}, {new} new tokens "
             f"(SGLang {(meta.get('sglang_versions') or {}).get('sglang') or '?'}, bench_one_batch); "
             "tokens/s of output tokens; ratio > 1: Manta faster"
             + (f"; native knobs: {' '.join(f'{k}={v}' for k, v in res['manta_knobs'].items())}"
                if res.get("manta_knobs") else ""), "",
             "| shape | batch | Manta decode | SGLang decode | ratio | Manta e2e | SGLang e2e | ratio "
             "| Manta prefill s | SGLang prefill s | notes |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in res["rows"]:
        notes = "; ".join(f"{k}: {v}" for k, v in r.get("errors", {}).items())
        lines.append(
            f"| {r['shape']} | {r['batch']} | {fmt(r.get('native_decode_tokens_per_s'))} | "
            f"{fmt(r.get('sglang_decode_tokens_per_s'))} | {fmt(r['native_over_sglang_decode'], '.2f')} | "
            f"{fmt(r.get('native_e2e_tokens_per_s'))} | {fmt(r.get('sglang_e2e_tokens_per_s'))} | "
            f"{fmt(r['native_over_sglang_e2e'], '.2f')} | {fmt(r.get('native_prefill_s'), '.4f')} | "
            f"{fmt(r.get('sglang_prefill_s'), '.4f')} | {notes[:300]} |")
    if roll:
        nat, sg = roll.get("native", {}), roll.get("sglang", {})
        lines += ["", "| rollout (bench/run_e2e.sh) | rollout s (median step) | rollout tok/s | step s |",
                  "|---|---:|---:|---:|"]
        for side, r in (("Manta disagg-sync", nat), ("SGLang sglang-disagg", sg)):
            lines.append(f"| {side} | {fmt(r.get('rollout_s'), '.2f')} | {fmt(r.get('rollout_tokens_per_s'))} | "
                         f"{fmt(r.get('step_s'), '.2f')} |")
        lines.append(f"| native over SGLang | {fmt(res['rollout_step_native_over_sglang'], '.2f')} | "
                     f"{fmt(res['rollout_tokens_per_s_native_over_sglang'], '.2f')} | |")
    if any("roofline" in r for r in res["rows"]):
        lines += ["", "Wall time against the floor (bench/py/roofline.py; fractions of the floor, higher is "
                  "closer to what the GPU allows):", "", roofline.table(res["rows"])]
    for w in warnings:
        lines.append(f"\nwarning: {w}")
    table = "\n".join(lines) + "\n"
    json.dump(res, open(os.path.join(out, "peers.json"), "w"), indent=2)
    open(os.path.join(out, "peers.md"), "w").write(table)
    print(table)
    print(json.dumps({k: v for k, v in res.items() if k.startswith(("native_over", "rollout_"))}, indent=1))


if __name__ == "__main__":
    main()
