"""Writes a random Qwen3-shaped model directory for bench/run_e2e.sh.

usage: e2e_model.py TINY_DIR OUT_DIR [0.6b|8b]

config.json has Qwen3-0.6B's shape (hidden 1024, 28 layers, 16/8 heads, head_dim 128,
vocab 151936, tied embeddings; the default) or Qwen3-8B's (hidden 4096, 36 layers, 32/8
heads, intermediate 12288, untied) and no weights file: Manta initialises the model from
--seed. The tokenizer is the tiny model's (bytes + ChatML specials), its vocabulary
padded with letter strings to 151936 ids so that every id the model samples decodes.
"""
import itertools
import json
import os
import shutil
import string
import sys

VOCAB = 151936
# The published Qwen3 configurations' sizes.
SHAPES = {
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
               num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
}


def main():
    tiny, out = sys.argv[1], sys.argv[2]
    shape = sys.argv[3] if len(sys.argv) > 3 else "0.6b"
    if shape not in SHAPES:
        sys.exit(f"e2e_model.py: unknown shape {shape!r} (known: {', '.join(SHAPES)})")
    os.makedirs(out, exist_ok=True)
    cfg = json.load(open(os.path.join(tiny, "config.json")))
    cfg.update(
        vocab_size=VOCAB,
        head_dim=128,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,
        torch_dtype="bfloat16",
        **SHAPES[shape],
    )
    json.dump(cfg, open(os.path.join(out, "config.json"), "w"), indent=2)
    tok = json.load(open(os.path.join(tiny, "tokenizer.json")))
    vocab = tok["model"]["vocab"]
    # The specials go into the model vocabulary at their own ids, so the vocabulary stays
    # contiguous and they keep them (added tokens missing from it are renumbered).
    for t in tok["added_tokens"]:
        vocab[t["content"]] = t["id"]
    taken = set(vocab)
    next_id = 1 + max(list(vocab.values()) + [t["id"] for t in tok["added_tokens"]])
    # Printable ASCII letters are themselves in the byte-level alphabet, so these decode.
    words = ("".join(w) for w in itertools.product(string.ascii_lowercase, repeat=4))
    for w in words:
        if next_id >= VOCAB:
            break
        if w not in taken:
            vocab[w] = next_id
            next_id += 1
    json.dump(tok, open(os.path.join(out, "tokenizer.json"), "w"))
    shutil.copy(os.path.join(tiny, "tokenizer_config.json"), out)
    print(f"wrote {out}: Qwen3-{shape.upper()} shape, vocab {next_id}", file=sys.stderr)


if __name__ == "__main__":
    main()
