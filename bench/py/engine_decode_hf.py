"""Baseline for bench/src/bin/engine_decode.rs: transformers `generate` on the same shapes
(random bf16 weights, B prompts of PROMPT tokens, NEW greedy tokens, no early stop).

usage: engine_decode_hf.py SHAPE(0.6b|8b) BATCHES(1,16,64) [PROMPT] [NEW]
"""

import json
import sys
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

SHAPES = {
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
               num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
}


def main() -> None:
    shape = sys.argv[1]
    batches = [int(b) for b in sys.argv[2].split(",")]
    prompt = int(sys.argv[3]) if len(sys.argv) > 3 else 512
    new = int(sys.argv[4]) if len(sys.argv) > 4 else 256
    config = Qwen3Config(vocab_size=151936, head_dim=128, rms_norm_eps=1e-6,
                         rope_theta=1e6, max_position_embeddings=40960, **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16).eval()
    rows = []
    def run(b, seed, new=new):
        g = torch.Generator(device="cuda").manual_seed(seed)
        ids = torch.randint(0, 150000, (b, prompt), device="cuda", generator=g)
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                 min_new_tokens=new, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t, (out.shape[1] - prompt) * b
    run(2, 99)
    for k, b in enumerate(batches):
        run(b, 500 + k, 8)  # warm-up at this batch size, as the Manta run does
        wall, tokens = run(b, k)
        # Prefill and first token alone, so the decode phase can be reported apart: the
        # median of three, as the Manta side does.
        prefill = sorted(run(b, 700 + 10 * k + r, 1)[0] for r in range(3))[1]
        decode = b * (new - 1) / (wall - prefill)
        rows.append({"batch": b, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
                     "prefill_s": prefill, "decode_tokens_per_s": decode})
        print(f"hf {shape} batch {b:>4}: {tokens / wall:.0f} tokens/s, decode {decode:.0f}", file=sys.stderr)
    print(json.dumps({"shape": shape, "impl": f"transformers {__import__('transformers').__version__} generate (sdpa)",
                      "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "results": rows}))


if __name__ == "__main__":
    main()
