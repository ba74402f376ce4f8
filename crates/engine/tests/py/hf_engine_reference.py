"""Reference numbers for the native engine tests, from transformers.

  hf_engine_reference.py init DIR SEED
      Random-init Qwen3ForCausalLM from DIR/config.json, saved to DIR as safetensors.
  hf_engine_reference.py score DIR < items.json
      items: [{"prompt": [...], "output": [...], "temperature": T}]. Prints, per item,
      {"logprobs": log_softmax(logits / T) at each output token,
       "first_probs": softmax(logits / T) at the last prompt position}.
"""

import json
import sys

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM


def init(model_dir: str, seed: int) -> None:
    torch.manual_seed(seed)
    config = Qwen3Config.from_pretrained(model_dir)
    model = Qwen3ForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(model_dir, safe_serialization=True)


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
    else:
        score(sys.argv[2])
