"""Reference numbers for the native engine tests, from transformers.

  hf_engine_reference.py init DIR SEED
      Random-init Qwen3ForCausalLM from DIR/config.json, saved to DIR as safetensors.
  hf_engine_reference.py score DIR < items.json
      items: [{"prompt": [...], "output": [...], "temperature": T}]. Prints, per item,
      {"logprobs": log_softmax(logits / T) at each output token,
       "first_probs": softmax(logits / T) at the last prompt position}.
  hf_engine_reference.py routed DIR < items.json
      Mixture-of-experts models. items: [[token, ...], ...]. Prints, per item, the
      top-k expert ids (ascending) each sparse layer's router picks for each token,
      [tokens][sparse layers][k].

`init` makes a Qwen3 or a Qwen3-MoE, by DIR/config.json's model_type.
"""

import json
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3ForCausalLM


def init(model_dir: str, seed: int) -> None:
    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)  # routers start near zero: give them clear choices
    model.save_pretrained(model_dir, safe_serialization=True)


def routed(model_dir: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    k = model.config.num_experts_per_tok
    results = []
    for tokens in json.load(sys.stdin):
        with torch.no_grad():
            res = model(torch.tensor([tokens]), output_router_logits=True)
        layers = [torch.topk(torch.softmax(r.float(), -1), k, -1).indices.sort(-1).values
                  for r in res.router_logits]
        results.append(torch.stack(layers, 1).tolist())
    print(json.dumps(results))


def score(model_dir: str) -> None:
    model = Qwen3ForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    results = []
    for item in json.load(sys.stdin):
        prompt, output, t = item["prompt"], item["output"], item["temperature"]
        ids = torch.tensor([prompt + output])
        with torch.no_grad():
            logits = model(ids).logits[0].to(torch.float64)
        logp = torch.log_softmax(logits / t, dim=-1)
        n = len(prompt)
        out_lp = [logp[n - 1 + i, tok].item() for i, tok in enumerate(output)]
        first = torch.softmax(logits[n - 1] / t, dim=-1).tolist()
        results.append({"logprobs": out_lp, "first_probs": first})
    print(json.dumps(results))


if __name__ == "__main__":
    if sys.argv[1] == "init":
        init(sys.argv[2], int(sys.argv[3]))
    elif sys.argv[1] == "routed":
        routed(sys.argv[2])
    else:
        score(sys.argv[2])
