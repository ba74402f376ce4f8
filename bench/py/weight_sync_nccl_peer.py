"""Python side of bench/run_weight_sync_nccl.sh: a torch.distributed member of an NCCL
weight-update group joined exactly as SGLang's engine joins one
(`init_custom_process_group`: tcp:// rendezvous, `store.set_timeout`,
`PrefixStore(group_name, store)`, torch's `_new_process_group_helper` with the NCCL
backend), receiving the way SGLang's `update_weights_from_distributed` does (one async
`broadcast(src=0)` per tensor in order, then wait).

usage:
  weight_sync_nccl_peer.py recv PORT REPS MANIFEST GROUP OUT.json   # rank 1 on cuda:1
  weight_sync_nccl_peer.py send PORT REPS MANIFEST GROUP OUT.json   # rank 0 on cuda:0 (torch baseline)
  weight_sync_nccl_peer.py digest MANIFEST                          # pattern checksums (CPU)
  BACKEND=gloo DEVICE=cpu ... runs the same protocol on the CPU (a check of this script).

MANIFEST is the JSON list of [name, shape] written by the Manta sender
(bench/src/bin/weight_sync_nccl.rs). Tensor contents are a deterministic integer hash
of (tensor index, element index) reinterpreted as bf16 bits, so both sides know the
expected bytes without sharing a random generator. Each timed round starts with a
one-element broadcast (a common start) and is timed on this side after
torch.cuda.synchronize(); the receiver's times are what the report compares.
"""

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    Backend,
    PrefixStore,
    _new_process_group_helper,
    _world,
    rendezvous,
)

BACKEND = os.environ.get("BACKEND", "nccl")


def pattern(index, shape, device):
    """bf16 tensor whose int16 bits are a hash of (index, element); same as the Rust side."""
    n = 1
    for s in shape:
        n *= s
    a = torch.arange(n, dtype=torch.int64, device=device) + (index * 7919 + 1)
    x = a * 2654435761
    x = x ^ (x >> 15)
    x = x & 0xFFFFFFF
    x = x * 2246822519
    x = x ^ (x >> 13)
    bits = (x & 0xFFFF) - 32768
    return bits.to(torch.int16).view(torch.bfloat16).reshape(shape)


def join(port, rank, world_size, group_name, timeout_s=600):
    """What SGLang's init_custom_process_group does for init_method tcp://127.0.0.1:PORT."""
    timeout = datetime.timedelta(seconds=timeout_s)
    it = rendezvous(f"tcp://127.0.0.1:{port}", rank, world_size, timeout=timeout)
    store, rank, world_size = next(it)
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(BACKEND),
        store,
        group_name=group_name,
        backend_options=None,
        timeout=timeout,
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def broadcast_all(tensors, pg):
    handles = [dist.broadcast(t, src=0, group=pg, async_op=True) for t in tensors]
    for h in handles:
        h.wait()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main():
    mode = sys.argv[1]
    if mode == "digest":
        manifest = json.load(open(sys.argv[2]))
        sums = [int(pattern(i, s, "cpu").view(torch.int16).to(torch.int64).sum())
                for i, (_, s) in enumerate(manifest)]
        print(json.dumps(sums))
        return
    port, reps, manifest_path, group_name, out = (
        int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6])
    manifest = json.load(open(manifest_path))
    rank = 1 if mode == "recv" else 0
    if os.environ.get("DEVICE", "cuda") == "cpu":
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    pg = join(port, rank, 2, group_name)
    shapes = [s for _, s in manifest]
    if rank == 0:
        tensors = [pattern(i, s, device) for i, s in enumerate(shapes)]
    else:
        tensors = [torch.empty(s, dtype=torch.bfloat16, device=device) for s in shapes]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    # Round 0: the check (and the communicator's creation).
    broadcast_all(tensors, pg)
    sync(device)
    mismatched = []
    if rank == 1:
        for i, (name, s) in enumerate(manifest):
            want = pattern(i, s, device)
            if not torch.equal(tensors[i].view(torch.int16), want.view(torch.int16)):
                mismatched.append(name)
    marker = torch.zeros(1, dtype=torch.bfloat16, device=device)
    seconds = []
    for _ in range(reps):
        dist.broadcast(marker, src=0, group=pg)
        sync(device)
        t0 = time.perf_counter()
        broadcast_all(tensors, pg)
        sync(device)
        seconds.append(time.perf_counter() - t0)
    result = {
        "role": mode,
        "rank": rank,
        "device": str(device),
        "backend": BACKEND,
        "tensors": len(tensors),
        "bytes": nbytes,
        "seconds": seconds,
        "median_s": sorted(seconds)[len(seconds) // 2] if seconds else None,
    }
    if rank == 1:
        result["bit_exact"] = not mismatched
        result["mismatched"] = mismatched[:20]
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    dist.destroy_process_group(pg)
    if rank == 1 and mismatched:
        print(f"weight_sync_nccl_peer: {len(mismatched)} tensors differ, first {mismatched[0]}",
              file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
