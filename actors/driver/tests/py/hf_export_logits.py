"""Reference for `driver export`: loads an exported directory the way a user would,
with transformers' AutoModelForCausalLM.from_pretrained (fp32, CPU, eager attention), and
writes its logits for one prompt.

Usage: hf_export_logits.py EXPORT_DIR PROMPT_IDS(comma-separated) OUT.safetensors
"""

import sys

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM


def main() -> None:
    export_dir, prompt_arg, out = sys.argv[1], sys.argv[2], sys.argv[3]
    ids = torch.tensor([[int(t) for t in prompt_arg.split(",")]])
    model = AutoModelForCausalLM.from_pretrained(
        export_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        logits = model(ids).logits.float().contiguous()
    save_file({"input_ids": ids, "logits": logits}, out)


if __name__ == "__main__":
    main()
