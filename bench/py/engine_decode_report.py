"""Combines engine_decode (Manta) and engine_decode_hf (transformers) results into
engine_decode.json and prints a table. usage: engine_decode_report.py OUT_DIR"""

import json
import os
import sys


def load(path):
    return json.load(open(path)) if os.path.exists(path) else None


def by_batch(run):
    return {r["batch"]: r for r in run["results"]} if run else {}


def main() -> None:
    out = sys.argv[1]
    gpu = open(os.path.join(out, "gpu.txt")).read().strip()
    res = {"device": os.environ.get("MANTA_DEVICE_KIND", "device machine") + ": " + gpu,
           "date": __import__("datetime").date.today().isoformat(),
           "benchmark": "native engine decode, random bf16 weights, prompt 512, 256 greedy new tokens",
           "gpu": open(os.path.join(out, "gpu.txt")).read().strip()}
    print(f"{'shape':<6}{'batch':>6}{'manta tok/s':>14}{'hf tok/s':>12}{'speedup':>9}{'bound tok/s':>13}{'of bound':>10}"
          f"{'decode':>10}{'hf decode':>11}{'speedup':>9}{'of bound':>10}")
    for shape, key in (("0.6b", "0_6b"), ("8b", "8b")):
        m = load(os.path.join(out, f"manta_{key}.json"))
        h = load(os.path.join(out, f"hf_{key}.json"))
        if not m:
            continue
        hb = by_batch(h)
        res[f"copy_bandwidth_gb_s_{key}"] = m["copy_bandwidth_bytes_per_s"] / 1e9
        table = {}
        for b, r in by_batch(m).items():
            hf = hb.get(b, {}).get("tokens_per_s")
            hf_dec = hb.get(b, {}).get("decode_tokens_per_s")
            dec = r.get("decode_tokens_per_s")
            table[str(b)] = {"manta_tokens_per_s": r["tokens_per_s"], "transformers_tokens_per_s": hf,
                             "bound_tokens_per_s": r["bound_tokens_per_s"],
                             "bandwidth_fraction": r["bandwidth_fraction"],
                             "manta_decode_tokens_per_s": dec, "transformers_decode_tokens_per_s": hf_dec,
                             "decode_bandwidth_fraction": r.get("decode_bandwidth_fraction")}
            sp = r["tokens_per_s"] / hf if hf else float("nan")
            dsp = dec / hf_dec if dec and hf_dec else float("nan")
            print(f"{shape:<6}{b:>6}{r['tokens_per_s']:>14.0f}{(hf or 0):>12.0f}{sp:>9.2f}"
                  f"{r['bound_tokens_per_s']:>13.0f}{100 * r['bandwidth_fraction']:>9.1f}%"
                  f"{(dec or 0):>10.0f}{(hf_dec or 0):>11.0f}{dsp:>9.2f}"
                  f"{100 * (r.get('decode_bandwidth_fraction') or 0):>9.1f}%")
        res[f"tokens_per_s_{key}"] = table
        if h:
            res["baseline"] = h["impl"]
    t06, t8 = res.get("tokens_per_s_0_6b", {}), res.get("tokens_per_s_8b", {})
    if "1" in t06:
        res["tokens_per_s_b1_0_6b"] = t06["1"]["manta_tokens_per_s"]
    if "64" in t06:
        res["bandwidth_fraction_b64"] = t06["64"]["bandwidth_fraction"]
        if t06["64"]["transformers_tokens_per_s"]:
            res["speedup_vs_transformers_b64"] = t06["64"]["manta_tokens_per_s"] / t06["64"]["transformers_tokens_per_s"]
    if "64" in t8:
        res["bandwidth_fraction_b64_8b"] = t8["64"]["bandwidth_fraction"]
        if t8["64"]["transformers_tokens_per_s"]:
            res["speedup_vs_transformers_b64_8b"] = t8["64"]["manta_tokens_per_s"] / t8["64"]["transformers_tokens_per_s"]
    # The decode phase alone (prefill and first token measured apart and subtracted, on
    # both sides), which is what the per-step bound describes.
    for key, t in (("", t06), ("_8b", t8)):
        r = t.get("64", {})
        if r.get("decode_bandwidth_fraction") is not None:
            res[f"decode_bandwidth_fraction_b64{key}"] = r["decode_bandwidth_fraction"]
        if r.get("manta_decode_tokens_per_s") and r.get("transformers_decode_tokens_per_s"):
            res[f"decode_speedup_vs_transformers_b64{key}"] = (
                r["manta_decode_tokens_per_s"] / r["transformers_decode_tokens_per_s"])
    if t06.get("1", {}).get("manta_decode_tokens_per_s"):
        res["decode_tokens_per_s_b1_0_6b"] = t06["1"]["manta_decode_tokens_per_s"]
    if "1" in t8:
        res["bandwidth_fraction_b1_8b"] = t8["1"]["bandwidth_fraction"]
    json.dump(res, open(os.path.join(out, "engine_decode.json"), "w"), indent=2)
    print(json.dumps({k: v for k, v in res.items() if not isinstance(v, dict)}, indent=1))


if __name__ == "__main__":
    main()
