"""Hugging Face reference side of the Qwen3-MoE parity tests (fp32, CPU).

make OUT   For each case, build a random-init transformers Qwen3MoeForCausalLM, save it
           under OUT/<case>/ with save_pretrained, and write OUT/<case>/expected.safetensors:
           `input_ids` [B, T] int64, fp32 `logits` [B, T, V], `routed` [B*T, sparse layers,
           k] int64 (the router's top-k ids per token, transformers' own choice), and
           `greedy` [new] int64 (greedy `generate` of `prompt` [P]) with fp32
           `greedy_logprobs` [new].
check DIR  For each DIR/<case>/ holding config.json written by Manta, load it with
           transformers (a missing or unexpected weight is an error) and write
           DIR/<case>/hf_logits.safetensors for `input_ids` in DIR/<case>/input.safetensors.
"""

import os
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

COMMON = dict(
    hidden_size=32,
    intermediate_size=40,
    moe_intermediate_size=24,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=61,
    num_experts=6,
    num_experts_per_tok=2,
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
    initializer_range=0.2,
    tie_word_embeddings=False,
    eos_token_id=None,
)

CASES = {
    # Renormalised top-k, every layer sparse.
    "renorm": dict(num_hidden_layers=2, norm_topk_prob=True),
    # Raw top-k probabilities, a dense layer (1) between sparse ones.
    "dense_layer": dict(num_hidden_layers=3, norm_topk_prob=False, mlp_only_layers=[1]),
    # Every second layer sparse (1 and 3).
    "step2": dict(num_hidden_layers=4, norm_topk_prob=True, decoder_sparse_step=2),
}

PROMPT = [5, 17, 42, 3, 7]
NEW_TOKENS = 12


def make(out):
    torch.manual_seed(0)
    for name, extra in CASES.items():
        cfg = Qwen3MoeConfig(**COMMON, **extra)
        model = Qwen3MoeForCausalLM(cfg).eval()
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "norm" in pname:
                    p.add_(torch.randn_like(p) * 0.2)
                if pname.endswith("mlp.gate.weight"):
                    p.normal_(0.0, 1.0)  # routers start at zero; give them choices to make
        d = os.path.join(out, name)
        model.save_pretrained(d)
        ids = torch.randint(0, cfg.vocab_size, (2, 7))
        with torch.no_grad():
            res = model(input_ids=ids, output_router_logits=True)
            sparse = [l for l in range(cfg.num_hidden_layers)
                      if l not in cfg.mlp_only_layers and (l + 1) % cfg.decoder_sparse_step == 0]
            assert len(res.router_logits) == len(sparse), (len(res.router_logits), sparse)
            routed = torch.stack(
                [torch.topk(torch.softmax(r.float(), -1), cfg.num_experts_per_tok, -1).indices
                 for r in res.router_logits], 1)
            res_gen = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS,
                                 do_sample=False, min_new_tokens=NEW_TOKENS,
                                 return_dict_in_generate=True, output_logits=True)
            gen = res_gen.sequences
            new = gen[0, len(PROMPT):]
            greedy_logprobs = torch.stack([
                torch.log_softmax(step[0].float(), -1)[tok] for step, tok in zip(res_gen.logits, new)])
        save_file({
            "input_ids": ids.contiguous(),
            "logits": res.logits.float().contiguous(),
            "routed": routed.contiguous(),
            "prompt": torch.tensor(PROMPT),
            "greedy": new.contiguous(),
            "greedy_logprobs": greedy_logprobs.contiguous(),
        }, os.path.join(d, "expected.safetensors"))


def check(root):
    for name in sorted(os.listdir(root)):
        d = os.path.join(root, name)
        if not os.path.isfile(os.path.join(d, "config.json")):
            continue
        model, info = AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
        bad = {k: v for k, v in info.items() if v and k != "error_msgs" or (k == "error_msgs" and v)}
        if bad:
            sys.exit(f"{d}: transformers reported {bad}")
        ids = load_file(os.path.join(d, "input.safetensors"))["input_ids"]
        with torch.no_grad():
            logits = model.eval()(input_ids=ids).logits.float()
        save_file({"logits": logits.contiguous()}, os.path.join(d, "hf_logits.safetensors"))


if __name__ == "__main__":
    {"make": make, "check": check}[sys.argv[1]](sys.argv[2])
