"""Reference side of the chat template parity test: render conversations with transformers.

Usage: chat_template_parity.py CASES_JSON
CASES_JSON is a list of {"dir", "messages", "tools", "add_generation_prompt", "extra"}. Prints a JSON
list with, per case, {"ok": rendered_text} or {"error": message}.
"""

import json
import sys

from transformers import AutoTokenizer

with open(sys.argv[1], encoding="utf-8") as f:
    cases = json.load(f)

tokenizers = {}
results = []
for case in cases:
    directory = case["dir"]
    if directory not in tokenizers:
        tokenizers[directory] = AutoTokenizer.from_pretrained(directory)
    try:
        text = tokenizers[directory].apply_chat_template(
            case["messages"],
            tools=case["tools"],
            add_generation_prompt=case["add_generation_prompt"],
            tokenize=False,
            **case["extra"],
        )
        results.append({"ok": text})
    except Exception as error:  # the Rust side checks that it fails too
        results.append({"error": f"{type(error).__name__}: {error}"})
json.dump(results, sys.stdout)
