"""Compares model.safetensors files tensor by tensor: `NAME=PATH` arguments, the first
the reference. Prints, for each other file, whether every tensor holds the same bits and
the largest absolute difference (in fp64); exits 1 unless all are the same bits.

bench/run_workers.sh trainer-dp2 compares data-parallel ranks on two workers with each
other and with local-mode ranks trained on the same saved rollouts: with two ranks each
reduced element is one fp32 addition (commutative), and every rank ends a step with the
same all-gathered bits, so all three must match exactly."""

import json
import struct
import sys

import torch

# safetensors dtype names -> torch dtypes (read here with torch alone, so the device
# machine needs no safetensors package).
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
    "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


def load_file(path):
    """A .safetensors file's tensors by name: an 8-byte header length, a JSON header of
    dtype, shape and byte offsets, then the data."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        start, end = meta["data_offsets"]
        raw = bytearray(data[start:end])
        t = torch.frombuffer(raw, dtype=DTYPES[meta["dtype"]]) if raw else torch.empty(0, dtype=DTYPES[meta["dtype"]])
        out[name] = t.reshape(meta["shape"])
    return out


def main(args):
    named = [a.split("=", 1) for a in args]
    if len(named) < 2 or any(len(n) != 2 for n in named):
        sys.exit("usage: compare_weights.py NAME=PATH NAME=PATH [NAME=PATH ...]")
    (ref_name, ref_path), *others = named
    ref = load_file(ref_path)
    same_everywhere = True
    for name, path in others:
        other = load_file(path)
        if sorted(other) != sorted(ref):
            print(f"{name} vs {ref_name}: tensor names differ")
            same_everywhere = False
            continue
        differing = [k for k in ref if not ref[k].equal(other[k])]
        worst = max(
            (ref[k].double() - other[k].double()).abs().max().item() for k in ref
        )
        verdict = "same bits" if not differing else f"{len(differing)} tensors differ"
        print(
            f"{name} vs {ref_name}: {verdict} over {len(ref)} tensors, "
            f"max |diff| {worst:.3g}" + (f" (first: {differing[0]})" if differing else "")
        )
        same_everywhere &= not differing
    sys.exit(0 if same_everywhere else 1)


if __name__ == "__main__":
    main(sys.argv[1:])
