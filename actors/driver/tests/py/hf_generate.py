"""Reference for `driver generate`: a small random Qwen3 saved in HF layout, and what
transformers' greedy `generate` produces from it.

Usage: hf_generate.py OUT_DIR PROMPT_IDS(comma-separated) MAX_NEW_TOKENS
Writes the checkpoint to OUT_DIR and prints the new ids as a JSON list on stdout.
"""

import json
import sys

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

VOCAB = 300


def main() -> None:
    out_dir, prompt_arg, max_new = sys.argv[1], sys.argv[2], int(sys.argv[3])
    prompt = [int(t) for t in prompt_arg.split(",")]
    torch.manual_seed(1234)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        # Wider than the default 0.02 so greedy choices are not near-ties.
        initializer_range=0.2,
        # The model's last id is its eos: generation may legitimately stop there, and
        # both sides must then agree (Manta keeps the stop token, as transformers does).
        bos_token_id=0,
        eos_token_id=VOCAB - 1,
        pad_token_id=0,
    )
    model = Qwen3ForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=config.eos_token_id,
            pad_token_id=0,
        )
    print(json.dumps(out[0, len(prompt):].tolist()))


if __name__ == "__main__":
    main()
