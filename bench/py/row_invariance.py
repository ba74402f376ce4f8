"""Which bf16 ops give a row the same bits whatever the number of rows beside it?

For true on-policy runs the engine (a few rows per decode step) and the trainer (thousands
of packed rows) must round every op alike. This computes each op of a Qwen3-0.6B layer on
4,096 rows and again on the first M rows alone, for several M, and prints the share of
output elements that differ. Run on a GPU (device machine):
python3 bench/py/row_invariance.py
"""

import torch
import torch.nn.functional as F


def main():
    torch.manual_seed(0)
    dev = "cuda"
    print(torch.__version__, torch.cuda.get_device_name())
    rows = 4096
    ms = [1, 2, 3, 8, 16, 32, 33, 64, 128, 256, 1024]
    shapes = {"q": (1024, 2048), "kv": (1024, 1024), "o": (2048, 1024),
              "gate_up": (1024, 3072), "down": (3072, 1024)}
    for name, (k, n) in shapes.items():
        x = torch.randn(rows, k, device=dev).bfloat16()
        w = (torch.randn(n, k, device=dev) * 0.02).bfloat16()
        full = F.linear(x, w)
        diffs = []
        for m in ms:
            part = F.linear(x[:m], w)
            diffs.append(f"{m}:{(part != full[:m]).float().mean().item() * 100:.1f}%")
        print(f"linear {name} [{k}->{n}]: " + " ".join(diffs))
    # lm_head with fp32 output
    x = torch.randn(rows, 1024, device=dev).bfloat16()
    w = (torch.randn(151936, 1024, device=dev) * 0.02).bfloat16()
    full = torch.mm(x, w.t(), out_dtype=torch.float32)
    diffs = []
    for m in ms:
        part = torch.mm(x[:m], w.t(), out_dtype=torch.float32)
        diffs.append(f"{m}:{(part != full[:m]).float().mean().item() * 100:.1f}%")
    print("mm_dtype lm_head fp32 out: " + " ".join(diffs))
    # rms_norm
    x = torch.randn(rows, 1024, device=dev).bfloat16()
    wn = torch.rand(1024, device=dev).bfloat16() + 0.5
    full = F.rms_norm(x, [1024], wn, 1e-6)
    diffs = []
    for m in ms:
        part = F.rms_norm(x[:m], [1024], wn, 1e-6)
        diffs.append(f"{m}:{(part != full[:m]).float().mean().item() * 100:.1f}%")
    print("rms_norm 1024: " + " ".join(diffs))
    xh = torch.randn(rows, 16, 128, device=dev).bfloat16()
    wh = torch.rand(128, device=dev).bfloat16() + 0.5
    full = F.rms_norm(xh, [128], wh, 1e-6)
    diffs = []
    for m in ms:
        part = F.rms_norm(xh[:m], [128], wh, 1e-6)
        diffs.append(f"{m}:{(part != full[:m]).float().mean().item() * 100:.1f}%")
    print("rms_norm head 128: " + " ".join(diffs))


if __name__ == "__main__":
    main()
