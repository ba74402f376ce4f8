"""Read bandwidth of a decode step's keys and values in two cache layouts (diagnostic).

The native engine's paged pools are [slot, kv_head, head_dim]: an attention CTA, which
owns one kv head, reads 256 of every 2,048 bytes (8 kv heads at head_dim 128). This
times one Triton kernel that streams every (sequence, kv head)'s keys and values, one
program per pair as the paged kernel's CTAs, over that layout and over a head-major one
([kv_head, slot, head_dim], each program's reads contiguous), at an 8B batch-64 step's
size (64 sequences x 640 tokens, 8 kv heads: 168 MB per layer), beside a device copy.

usage: python3 bench/py/probe_kv_layout.py [BATCH] [CONTEXT]
"""
import json
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def stream_kv(kp, vp, out, T: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, BT: tl.constexpr,
              HEAD_MAJOR: tl.constexpr, SLOTS: tl.constexpr):
    h = tl.program_id(0)
    b = tl.program_id(1)
    d = tl.arange(0, HD)
    acc = tl.zeros([BT, HD], dtype=tl.float32)
    for t0 in range(0, T, BT):
        slot = b * T + t0 + tl.arange(0, BT)
        if HEAD_MAJOR:
            row = h * SLOTS + slot
        else:
            row = slot * NKV + h
        off = row.to(tl.int64)[:, None] * HD + d[None, :]
        acc += tl.load(kp + off).to(tl.float32) + tl.load(vp + off).to(tl.float32)
    tl.store(out + (b * NKV + h) * HD + d, tl.sum(acc, 0))


def timed(fn, reps=50):
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(reps):
            fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) * 1e3 / reps)
    return sorted(times)[len(times) // 2]


def main():
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    ctx = int(sys.argv[2]) if len(sys.argv) > 2 else 640
    nkv, hd = 8, 128
    slots = batch * ctx
    # Four layers' worth of pools, cycled, so L2 (50 MB) holds none of the next one.
    pools = [(torch.randn(slots, nkv, hd, device="cuda", dtype=torch.bfloat16),
              torch.randn(slots, nkv, hd, device="cuda", dtype=torch.bfloat16)) for _ in range(4)]
    out = torch.empty(batch, nkv, hd, device="cuda", dtype=torch.float32)
    nbytes = 2 * slots * nkv * hd * 2
    report = {"batch": batch, "context": ctx, "bytes_per_layer": nbytes}
    for name, head_major in [("slot_major", False), ("head_major", True)]:
        for bt in (16, 32, 64):
            for warps in (4, 8):
                i = [0]

                def run():
                    k, v = pools[i[0] % 4]
                    i[0] += 1
                    stream_kv[(nkv, batch)](k, v, out, T=ctx, NKV=nkv, HD=hd, BT=bt, HEAD_MAJOR=head_major,
                                            SLOTS=slots, num_warps=warps)

                us = timed(run)
                key = f"{name}_bt{bt}_w{warps}"
                report[key + "_us"] = us
                print(f"{key:24s} {us:8.1f} us  {nbytes / us / 1e6:6.2f} TB/s", flush=True)
    src = torch.empty(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    us = timed(lambda: dst.copy_(src))
    report["copy_us"] = us
    print(f"{'device copy (r+w)':24s} {us:8.1f} us  {2 * nbytes / us / 1e6:6.2f} TB/s")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
