"""Which rounding does the trainer's attention (PyTorch SDPA, causal, bf16) apply?

Compares SDPA's bf16 output bit for bit with transcriptions of candidate algorithms:

- fa2: FlashAttention-2's forward as its source reads: keys in blocks of 64 walked from the
  row's last block down to block 0, a running max per row, weights exp2(s*scale_log2 -
  max*scale_log2) rounded to bf16 for the product with V, the fp32 row sum and accumulator
  rescaled at each block, output = acc * (1 / sum) rounded to bf16;
- fa2_fwd: the same with blocks walked first to last;
- global: one softmax with the row's global max, weights rounded to bf16 for the product;
- exact: fp32 softmax and product, rounded once at the end.

Run on a GPU (device machine): python3 bench/py/attention_numerics.py
Prints, per shape, the share of output elements equal to SDPA's and the largest difference.
"""

import math

import torch
import torch.nn.functional as F

BLOCK_N = 64
HEAD_DIM = 128


def scores(q, k):
    """q [B, H, L, D], k [B, Hkv, L, D] bf16 -> fp32 q.k [B, H, L, L] (products exact)."""
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    return torch.matmul(q.float(), k.float().transpose(-1, -2))


def values(q, v):
    rep = q.shape[1] // v.shape[1]
    return v.repeat_interleave(rep, dim=1).float()


def flash2(q, k, v, reverse=True):
    s_all = scores(q, k)
    vv = values(q, v)
    L = q.shape[2]
    scale = torch.tensor(1.0 / math.sqrt(HEAD_DIM), dtype=torch.float32).item()
    scale_log2 = float(torch.tensor(scale * math.log2(math.e), dtype=torch.float32))
    pos = torch.arange(L, device=q.device)
    causal = pos[None, :] <= pos[:, None]  # [L, L] key <= query
    s_all = s_all.masked_fill(~causal, float("-inf"))
    shape = s_all.shape[:-1]
    m = torch.full(shape, float("-inf"), device=q.device)
    l = torch.zeros(shape, device=q.device)
    acc = torch.zeros(*shape, HEAD_DIM, device=q.device)
    nb = (L + BLOCK_N - 1) // BLOCK_N
    order = range(nb - 1, -1, -1) if reverse else range(nb)
    for j in order:
        lo, hi = j * BLOCK_N, min((j + 1) * BLOCK_N, L)
        active = (pos >= lo)[None, None, :]  # rows whose causal range reaches this block
        s = s_all[..., lo:hi]
        m_new = torch.maximum(m, s.amax(-1))
        m_cur = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
        rescale = torch.exp2((m - m_cur) * scale_log2)
        max_scaled = (m_cur * scale_log2).float()
        # exp2f(fma(s, scale_log2, -max_scaled)): the fma rounds once.
        x = (s.double() * scale_log2 - max_scaled.double()[..., None]).float()
        p = torch.exp2(x)
        l_new = l * rescale + p.sum(-1)
        acc_new = acc * rescale[..., None] + torch.matmul(
            p.bfloat16().float(), vv[..., lo:hi, :]
        )
        m = torch.where(active, m_new, m)
        l = torch.where(active, l_new, l)
        acc = torch.where(active[..., None], acc_new, acc)
    inv = torch.where((l == 0) | (l != l), torch.ones_like(l), 1.0 / l)
    return (acc * inv[..., None]).bfloat16()


def global_max(q, k, v, round_weights=True):
    s = scores(q, k) / math.sqrt(HEAD_DIM)
    L = q.shape[2]
    pos = torch.arange(L, device=q.device)
    s = s.masked_fill(~(pos[None, :] <= pos[:, None]), float("-inf"))
    p = torch.exp(s - s.amax(-1, keepdim=True))
    w = p.bfloat16().float() if round_weights else p
    return (torch.matmul(w, values(q, v)) / p.sum(-1, keepdim=True)).bfloat16()


def compare(name, got, ref):
    eq = (got == ref).float().mean().item()
    diff = (got.float() - ref.float()).abs().max().item()
    return f"{name}: equal {eq * 100:.3f} %, max diff {diff:.3g}"


def main():
    torch.manual_seed(0)
    dev = "cuda"
    print(torch.__version__, torch.cuda.get_device_name())
    for b, h, hkv, L in [(1, 16, 8, 600), (8, 16, 8, 300), (1, 16, 8, 100), (32, 16, 8, 200), (2, 32, 8, 700)]:
        q = torch.randn(b, h, L, HEAD_DIM, device=dev).bfloat16()
        k = torch.randn(b, hkv, L, HEAD_DIM, device=dev).bfloat16()
        v = torch.randn(b, hkv, L, HEAD_DIM, device=dev).bfloat16()
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        lines = []
        for backend in [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]:
            try:
                with sdpa_kernel(backend):
                    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                lines.append(compare(f"sdpa[{backend.name}]", o, ref))
            except RuntimeError as e:
                lines.append(f"sdpa[{backend.name}]: {str(e).splitlines()[0][:80]}")
        lines.append(compare("fa2", flash2(q, k, v), ref))
        lines.append(compare("fa2_fwd", flash2(q, k, v, reverse=False), ref))
        lines.append(compare("global", global_max(q, k, v), ref))
        lines.append(compare("exact", global_max(q, k, v, round_weights=False), ref))
        print(f"B={b} H={h} Hkv={hkv} L={L}")
        for line in lines:
            print("  " + line)


if __name__ == "__main__":
    main()
