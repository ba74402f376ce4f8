"""Hugging Face reference side of the manta-model parity tests.

make OUT   For each case, build a tiny random-init transformers model with odd shapes
           (head_dim != hidden/heads, GQA ratio 4), save it under OUT/<case>/ with
           save_pretrained, and write OUT/<case>/expected.safetensors holding `input_ids`
           [B, T] int64 and the model's fp32 `logits` [B, T, V].
check DIR  For each DIR/<case>/ that holds config.json (a checkpoint written by Manta), load
           it with transformers and write DIR/<case>/hf_logits.safetensors for the
           `input_ids` stored beside it in DIR/<case>/input.safetensors.

Any missing or unexpected weight is an error, so a silently re-initialised tensor cannot
pass the comparison.
"""

import os
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=1,
    vocab_size=97,
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
    initializer_range=0.1,
    tie_word_embeddings=False,
)


def cases():
    """(name, model class, config, save kwargs) for every reference checkpoint."""
    yield "qwen3", Qwen3ForCausalLM, Qwen3Config(head_dim=24, rope_theta=1e6, **COMMON), {}
    tied = dict(COMMON, tie_word_embeddings=True)
    yield "qwen3_tied", Qwen3ForCausalLM, Qwen3Config(head_dim=24, **tied), {}
    yield "qwen2", Qwen2ForCausalLM, Qwen2Config(head_dim=24, rope_theta=1e6, **COMMON), {}
    llama3 = dict(
        rope_type="llama3",
        factor=4.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=16,
        rope_theta=500000.0,
    )
    yield "llama3", LlamaForCausalLM, LlamaConfig(head_dim=24, rope_scaling=llama3, **COMMON), {}
    yield "qwen3_sharded", Qwen3ForCausalLM, Qwen3Config(head_dim=24, **COMMON), {
        "max_shard_size": "30KB"
    }


def input_ids(vocab):
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, vocab, (2, 40), generator=g)


def logits_of(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float().contiguous()


def make(out):
    for i, (name, cls, cfg, save_kw) in enumerate(cases()):
        torch.manual_seed(1234 + i)
        model = cls(cfg).float().eval()
        with torch.no_grad():
            # Non-trivial norm weights and biases, so loading them wrongly shows in logits.
            for pname, p in model.named_parameters():
                if "norm" in pname:
                    p.normal_(1.0, 0.2)
                elif pname.endswith("bias"):
                    p.normal_(0.0, 0.2)
        d = os.path.join(out, name)
        model.save_pretrained(d, **save_kw)
        ids = input_ids(cfg.vocab_size)
        save_file(
            {"input_ids": ids, "logits": logits_of(model, ids)},
            os.path.join(d, "expected.safetensors"),
        )


def check(root):
    for name in sorted(os.listdir(root)):
        d = os.path.join(root, name)
        if not os.path.isfile(os.path.join(d, "config.json")):
            continue
        model, info = AutoModelForCausalLM.from_pretrained(
            d, dtype=torch.float32, output_loading_info=True
        )
        bad = {k: v for k, v in info.items() if v}
        if bad:
            raise SystemExit(f"{d}: transformers reported loading problems: {bad}")
        ids = load_file(os.path.join(d, "input.safetensors"))["input_ids"]
        save_file({"logits": logits_of(model.eval(), ids)}, os.path.join(d, "hf_logits.safetensors"))


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("make", "check"):
        raise SystemExit("usage: hf_parity.py make OUT | check DIR")
    torch.set_num_threads(2)
    (make if sys.argv[1] == "make" else check)(sys.argv[2])
