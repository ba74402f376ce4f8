"""Which bf16 ops give a row the same bits whatever the number of rows beside it?

For true on-policy runs the engine (a few rows per decode step) and the trainer (thousands
of packed rows) must round every op alike. This computes each op of a Qwen3-0.6B layer on
4,096 rows and again on the first M rows alone, for several M, and prints the share of
output elements that differ. Run on a GPU (device machine):
python3 bench/py/row_invariance.py
"""

import torch
import torch.nn.functional as F


def differing(op, x, ms):
    """Share of each M-row prefix's outputs that differ from the same rows among all of x."""
    full = op(x)
    return " ".join(f"{m}:{(op(x[:m]) != full[:m]).float().mean().item() * 100:.1f}%" for m in ms)


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
        print(f"linear {name} [{k}->{n}]: " + differing(lambda a: F.linear(a, w), x, ms))
    x = torch.randn(rows, 1024, device=dev).bfloat16()
    w = (torch.randn(151936, 1024, device=dev) * 0.02).bfloat16()
    print("mm_dtype lm_head fp32 out: "
          + differing(lambda a: torch.mm(a, w.t(), out_dtype=torch.float32), x, ms))
    wn = torch.rand(1024, device=dev).bfloat16() + 0.5
    print("rms_norm 1024: " + differing(lambda a: F.rms_norm(a, [1024], wn, 1e-6), x, ms))
    xh = torch.randn(rows, 16, 128, device=dev).bfloat16()
    wh = torch.rand(128, device=dev).bfloat16() + 0.5
    print("rms_norm head 128: " + differing(lambda a: F.rms_norm(a, [128], wh, 1e-6), xh, ms))


if __name__ == "__main__":
    main()
