"""Reference side of tests/hf_parity.rs: load a model directory with transformers and report what it does.

Usage: tokenizer_parity.py MODEL_DIR CASES_JSON
CASES_JSON is a list of strings. Prints JSON: the vocabulary size, special token ids, and for every
string its ids (no special tokens added) and both decodings; plus what the config.json builds.
"""

import json
import sys

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

model_dir, cases_path = sys.argv[1], sys.argv[2]
with open(cases_path, encoding="utf-8") as f:
    texts = json.load(f)

tokenizer = AutoTokenizer.from_pretrained(model_dir)
encoded = []
for text in texts:
    ids = tokenizer.encode(text, add_special_tokens=False)
    encoded.append(
        {
            "ids": ids,
            "decoded": tokenizer.decode(ids, skip_special_tokens=False),
            "decoded_skip_special": tokenizer.decode(ids, skip_special_tokens=True),
        }
    )

config = AutoConfig.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_config(config)
embeddings = model.get_input_embeddings().weight
json.dump(
    {
        "vocab_size": len(tokenizer),
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "encoded": encoded,
        "model_class": type(model).__name__,
        "embedding_shape": list(embeddings.shape),
        "tied": model.lm_head.weight.data_ptr() == embeddings.data_ptr(),
        "config_eos_token_id": config.eos_token_id,
        "model_max_length": tokenizer.model_max_length,
    },
    sys.stdout,
)
