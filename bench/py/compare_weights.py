"""Compares model.safetensors files tensor by tensor: `NAME=PATH` arguments, the first
the reference. Prints, for each other file, whether every tensor holds the same bits and
the largest absolute difference (in fp64); exits 1 unless all are the same bits.

bench/run_workers.sh trainer-dp2 compares data-parallel ranks on two workers with each
other and with local-mode ranks trained on the same saved rollouts: with two ranks each
reduced element is one fp32 addition (commutative), and every rank ends a step with the
same all-gathered bits, so all three must match exactly."""

import sys

from safetensors.torch import load_file


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
