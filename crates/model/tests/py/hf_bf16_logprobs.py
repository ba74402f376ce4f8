"""Hugging Face reference for the bf16 log-prob tests (tests/bf16_logprobs.rs).

    hf_bf16_logprobs.py DIR

DIR holds a checkpoint written by Manta (config.json + safetensors, fp32 weights) and
`input.safetensors` with `tokens` [N] int64 (sequences back to back), `lengths` [S] and
`prompt_lens` [S] int64. Loads the model in bf16 with transformers' default (SDPA)
attention, runs each sequence alone, and writes DIR/hf_logprobs.safetensors with `logp`
[sum(lengths - prompt_lens)] float32: the log-prob of every token after its prompt, from
fp32 logits of the bf16 final hidden states (as Manta's `logits_f32` computes them).
"""

import os
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM


def main(d):
    inputs = load_file(os.path.join(d, "input.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.eval()
    head = model.get_output_embeddings().weight.float()
    tokens, lengths, prompts = inputs["tokens"], inputs["lengths"], inputs["prompt_lens"]
    out = []
    start = 0
    with torch.no_grad():
        for length, prompt in zip(lengths.tolist(), prompts.tolist()):
            seq = tokens[start : start + length]
            hidden = model.model(input_ids=seq[None]).last_hidden_state[0]
            logits = hidden[prompt - 1 : length - 1].float() @ head.T
            logp = logits.log_softmax(-1).gather(-1, seq[prompt:, None])[:, 0]
            out.append(logp)
            start += length
    save_file({"logp": torch.cat(out).contiguous()}, os.path.join(d, "hf_logprobs.safetensors"))


if __name__ == "__main__":
    main(sys.argv[1])
