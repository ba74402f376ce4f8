"""cuBLAS time of a decode step's projections, one shape at a time (diagnostic).

Times torch's bf16 linear (the cuBLAS call the native engine makes above two rows) for each
projection of a Qwen3 shape at a given row count, and the LM head's bf16 -> fp32 product,
as CUDA-graph replays over four copies of each weight (so L2 cannot hold it). Prints each
one's time and read bandwidth, and the sum over the model's layers: what a decode step
spends in cuBLAS, to set against bench/decode_step's whole-step time.

usage: python3 bench/py/probe_decode_gemms.py SHAPE(0.6b|8b) ROWS [ROWS ...]
MANTA_PROBE_BLAS=cublaslt times torch's cuBLASLt path instead of its cuBLAS default.
"""
import json
import os
import sys

import torch

SHAPES = {
    "0.6b": dict(hidden=1024, inter=3072, heads=16, kv=8, hd=128, layers=28, vocab=151936),
    "8b": dict(hidden=4096, inter=12288, heads=32, kv=8, hd=128, layers=36, vocab=151936),
}


def timed(fn, reps=20):
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return sorted(times)[3]


def main():
    shape = SHAPES[sys.argv[1]]
    h, i = shape["hidden"], shape["inter"]
    q, kv = shape["heads"] * shape["hd"], shape["kv"] * shape["hd"]
    projections = {
        "qkv": (q + 2 * kv, h),
        "o": (h, q),
        "gate_up": (2 * i, h),
        "down": (h, i),
    }
    dev = torch.device("cuda")
    if os.environ.get("MANTA_PROBE_BLAS"):
        torch.backends.cuda.preferred_blas_library(os.environ["MANTA_PROBE_BLAS"])
    results = []
    for rows in [int(r) for r in sys.argv[2:]]:
        total = 0.0
        for name, (n, k) in projections.items():
            ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(4)]
            x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
            idx = [0]

            def run():
                torch.nn.functional.linear(x, ws[idx[0] % 4])
                idx[0] += 1

            us = timed(run)
            total += us * shape["layers"]
            results.append(dict(rows=rows, op=name, n=n, k=k, us=us, gb_s=n * k * 2 / us / 1e3))
            del ws
        ws = [torch.randn(shape["vocab"], h, device=dev, dtype=torch.bfloat16) for _ in range(2)]
        x = torch.randn(rows, h, device=dev, dtype=torch.bfloat16)
        idx = [0]

        def head():
            torch.mm(x, ws[idx[0] % 2].t(), out_dtype=torch.float32)
            idx[0] += 1

        us = timed(head)
        total += us
        results.append(dict(rows=rows, op="lm_head_f32", n=shape["vocab"], k=h, us=us,
                            gb_s=shape["vocab"] * h * 2 / us / 1e3))
        del ws
        results.append(dict(rows=rows, op="all_layers_plus_head", us=total))
    for r in results:
        print(f"{sys.argv[1]} rows {r['rows']:4d} {r['op']:>22}: {r['us']:9.1f} us"
              + (f"  {r['gb_s']:7.0f} GB/s" if "gb_s" in r else ""), file=sys.stderr)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
