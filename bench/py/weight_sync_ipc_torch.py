"""PyTorch baseline for bench/src/bin/weight_sync_ipc.rs `ipc`: the same Qwen3-shaped
random bf16 tensors handed to a child process through torch.multiprocessing (CUDA IPC
handles, as SGLang's colocated update_weights_from_tensor path does), mapped once, then
copied into the child's own tensors REPS times. Prints one JSON object.

usage: weight_sync_ipc_torch.py SHAPE(0.6b|8b) [REPS]"""

import json
import sys
import time

import torch
import torch.multiprocessing as mp

SHAPES = {
    # vocab, hidden, intermediate, layers, heads, kv heads, head dim, tied
    "0.6b": (151936, 1024, 3072, 28, 16, 8, 128, True),
    "8b": (151936, 4096, 12288, 36, 32, 8, 128, False),
}


def tensor_shapes(shape):
    v, h, i, layers, nh, nkv, hd, tied = SHAPES[shape]
    out = [(v, h)]
    for _ in range(layers):
        out += [(nh * hd, h), (nkv * hd, h), (nkv * hd, h), (h, nh * hd), (hd,), (hd,),
                (i, h), (i, h), (h, i), (h,), (h,)]
    out.append((h,))
    if not tied:
        out.append((v, h))
    return out


def child(q_in, q_out, reps):
    shared = q_in.get()  # CUDA tensors arrive as IPC handles and are mapped here
    own = [torch.zeros_like(t) for t in shared]
    torch.cuda.synchronize()
    times = []
    for _ in range(reps + 2):
        q_in.get()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for d, s in zip(own, shared):
            d.copy_(s)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    equal = all(torch.equal(d.view(torch.int16), s.view(torch.int16)) for d, s in zip(own, shared))
    q_out.put((times[2:], equal))
    q_in.get()


def main():
    shape = sys.argv[1]
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    torch.manual_seed(1)
    src = [torch.randn(s, dtype=torch.bfloat16, device="cuda") for s in tensor_shapes(shape)]
    nbytes = sum(t.numel() * 2 for t in src)
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(q_in, q_out, reps))
    p.start()
    q_in.put(src)
    for r in range(reps + 2):
        q_in.put(r)
    times, equal = q_out.get()
    q_in.put("quit")
    p.join()
    times.sort()
    ms = times[len(times) // 2]
    print(json.dumps({"shape": shape, "impl": f"torch {torch.__version__} multiprocessing CUDA IPC",
                      "bytes": nbytes, "ipc_copy_ms": ms, "ipc_gb_s": nbytes / ms / 1e6,
                      "bit_exact": equal, "reps": reps}))


if __name__ == "__main__":
    main()
