"""Baseline for bench model_step: transformers' Qwen3ForCausalLM, random init, bf16,
PyTorch eager (no torch.compile; SDPA attention, transformers' default), forward +
backward with the next-token loss. Prints one JSON object.

usage: python model_step_hf.py [BATCH] [SEQ] [ITERS]
"""
import json
import sys
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM


def main():
    batch, seq, iters = (int(a) for a in (sys.argv[1:] + ["8", "2048", "10"][len(sys.argv) - 1:])[:3])
    cfg = Qwen3Config(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1e6, tie_word_embeddings=True, max_position_embeddings=40960,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).to(dtype=torch.bfloat16, device="cuda")
    model.train()
    ids = torch.randint(cfg.vocab_size, (batch, seq), device="cuda")

    def step():
        model.zero_grad(set_to_none=False)
        out = model(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        return out.loss

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    times = []
    loss = None
    for _ in range(iters):
        t0 = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    median = sorted(times)[len(times) // 2]
    print(json.dumps({
        "impl": "transformers Qwen3ForCausalLM (PyTorch eager, sdpa)",
        "attn_implementation": model.config._attn_implementation,
        "batch": batch, "seq": seq, "iters": iters,
        "median_s": median, "times_s": times,
        "tokens_per_s": batch * seq / median, "loss": float(loss),
        "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0),
    }))


if __name__ == "__main__":
    main()
