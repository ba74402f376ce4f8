"""How far each side of the peer benchmark is from what the GPU allows: a roofline for
bench/run_peers.sh's rows (B requests of a PROMPT-token prompt, NEW greedy new tokens).

usage: roofline.py PEERS_JSON [--bandwidth-gb-s BW] [--peak-tflops 989] [--write]

The floor of one row's wall time is the prefill's FLOPs at the dense bf16 peak, plus NEW-1
decode steps, each the sum of two kernel families that run one after the other:
  projections (every layer's matrices and the LM head): max(weight bytes / BW,
    B x 2 x parameters / peak), and
  attention: max(B x average context x KV bytes per token / BW, its FLOPs / peak),
with BW the device's measured copy bandwidth (engine_decode's copy_bandwidth_gb_s_<shape>,
or --bandwidth-gb-s). Per row it gives each side's wall time as a fraction of that floor
(SGLang's and Manta's), the fraction a 1.3x end-to-end lead over SGLang would need, and the
largest lead SGLang's time leaves possible (its wall over the floor). The floor ignores what
neither engine can avoid (kernel launches, sampling, norms, the host), so 100 % is not
reachable; it says which rows a target asks near-perfect kernels of.

--write adds the rows' "roofline" to PEERS_JSON. Standard library only.
"""
import argparse
import json
import sys

# The Qwen3 shapes the peer benchmark uses (bench/src/lib.rs, qwen3_tensor_shapes):
# vocab, hidden, intermediate, layers, query heads, key/value heads, head dim.
SHAPES = {
    "0.6b": (151936, 1024, 3072, 28, 16, 8, 128),
    "4b": (151936, 2560, 9728, 36, 32, 8, 128),
    "8b": (151936, 4096, 12288, 36, 32, 8, 128),
}
H100_H200_BF16_DENSE_TFLOPS = 989.0
TARGET = 1.3


def floor_s(shape, batch, prompt, new, bandwidth, peak):
    """(prefill floor, decode step floor, end-to-end floor) in seconds."""
    v, h, i, layers, nh, nkv, hd = SHAPES[shape]
    layer = 2 * h * nh * hd + 2 * h * nkv * hd + 3 * h * i
    params = layers * layer
    head = v * h
    weight_bytes = (params + head) * 2
    kv_bytes_per_token = 2 * layers * nkv * hd * 2
    attn_flops_per_pair = 4 * layers * nh * hd  # QK^T and PV, per (query, key) pair
    prefill = (2 * params * prompt * batch + attn_flops_per_pair * prompt * prompt / 2 * batch
               + 2 * head * batch) / peak
    ctx = prompt + new / 2
    projections = max(weight_bytes / bandwidth, batch * 2 * (params + head) / peak)
    attention = max(batch * ctx * kv_bytes_per_token / bandwidth, batch * ctx * attn_flops_per_pair / peak)
    step = projections + attention
    return prefill, step, prefill + (new - 1) * step


def side_value(row, side, what):
    """A row's figure for one side: peers_report.py writes native_*, older tables manta_*."""
    names = (f"native_{what}", f"manta_{what}") if side == "native" else (f"{side}_{what}",)
    return next((row[n] for n in names if row.get(n) is not None), None)


def row_roofline(row, prompt, new, bandwidth, peak):
    shape, b = row["shape"], row["batch"]
    if shape not in SHAPES:
        return None
    prefill, step, floor = floor_s(shape, b, prompt, new, bandwidth, peak)
    out = {"prefill_floor_s": prefill, "decode_step_floor_s": step, "e2e_floor_s": floor}
    for side in ("native", "sglang"):
        tps, pre = side_value(row, side, "e2e_tokens_per_s"), side_value(row, side, "prefill_s")
        if tps:
            wall = b * new / tps
            out[f"{side}_wall_s"] = wall
            out[f"{side}_fraction_of_floor"] = floor / wall
            if pre:
                out[f"{side}_prefill_fraction_of_floor"] = prefill / pre
                out[f"{side}_decode_step_fraction_of_floor"] = step / ((wall - pre) / (new - 1))
    if "sglang_wall_s" in out:
        out["fraction_of_floor_for_target"] = floor / (out["sglang_wall_s"] / TARGET)
        out["largest_possible_native_over_sglang"] = out["sglang_wall_s"] / floor
    return out


def bandwidth_of(doc, shape):
    gb = doc.get(f"copy_bandwidth_gb_s_{shape.replace('.', '_')}")
    return gb * 1e9 if gb else None


def table(rows):
    lines = ["| shape | batch | floor s (prefill + steps) | SGLang | Manta | 1.3x needs | largest possible |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    pct = lambda x: "-" if x is None else f"{100 * x:.0f} %"
    for r in rows:
        f = r.get("roofline")
        if not f:
            continue
        lines.append(f"| {r['shape']} | {r['batch']} | {f['e2e_floor_s']:.3f} ({f['prefill_floor_s']:.3f} + "
                     f"{1e3 * f['decode_step_floor_s']:.2f} ms x steps) | {pct(f.get('sglang_fraction_of_floor'))} | "
                     f"{pct(f.get('native_fraction_of_floor'))} | {pct(f.get('fraction_of_floor_for_target'))} | "
                     f"{f.get('largest_possible_native_over_sglang', 0):.2f}x |")
    return "\n".join(lines)


def annotate(doc, bandwidth=None, peak=H100_H200_BF16_DENSE_TFLOPS * 1e12):
    """Adds "roofline" to every row of a peers.json document it can; returns the rows."""
    prompt, new = doc.get("prompt", 512), doc.get("new_tokens", 256)
    done = []
    for row in doc.get("rows", []):
        bw = bandwidth or bandwidth_of(doc, row["shape"])
        if not bw:
            continue
        f = row_roofline(row, prompt, new, bw, peak)
        if f:
            row["roofline"] = {"bandwidth_gb_s": bw / 1e9, "peak_tflops": peak / 1e12, **f}
            done.append(row)
    return done


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("peers", help="peers.json (bench/py/peers_report.py)")
    p.add_argument("--bandwidth-gb-s", type=float, help="copy bandwidth, where the file has none")
    p.add_argument("--peak-tflops", type=float, default=H100_H200_BF16_DENSE_TFLOPS,
                   help="dense bf16 peak (989: H100 and H200 SXM)")
    p.add_argument("--write", action="store_true", help="add the rows' roofline to the file")
    args = p.parse_args(argv)
    try:
        with open(args.peers, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f"roofline: cannot read {args.peers}: {e}")
    bw = args.bandwidth_gb_s * 1e9 if args.bandwidth_gb_s else None
    rows = annotate(doc, bw, args.peak_tflops * 1e12)
    if not rows:
        sys.exit(f"roofline: no row of {args.peers} has a copy bandwidth; pass --bandwidth-gb-s")
    print(table(doc["rows"]))
    if args.write:
        with open(args.peers, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
