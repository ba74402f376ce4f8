"""The cookbook's prepare_tasks.py selection, applied to a local ORS server: Python's
`random.seed(seed)` once; per environment (config order) and split, the listed tasks
`random.shuffle`d and cut to `num_samples or max_tasks`; a final `random.shuffle(rows)`;
rows written with `json.dumps` (hash: sha256 of `json.dumps(spec, sort_keys=True)`).
Tasks are listed over HTTP (POST /{variant}/tasks) because the SDK's client talks to the
platform; the identity fields are those the SDK's Task has for `Owner/Name`.

Usage: python cookbook_prepare_tasks.py BASE_URL SPEC_JSON OUTPUT
SPEC_JSON: {"seed": 42, "max_tasks": null,
            "environments": [["Owner/Name", "variant", ["train"], num_samples], ...]}
"""
import hashlib
import json
import random
import sys
import urllib.request


def list_tasks(base: str, variant: str, split: str) -> tuple[list, str]:
    req = urllib.request.Request(
        f"{base}/{variant}/tasks", data=json.dumps({"split": split}).encode(),
        headers={"content-type": "application/json"}, method="POST")
    with urllib.request.urlopen(req) as resp:
        body = json.loads(resp.read())
    return body["tasks"], body["env_name"]


def main() -> None:
    base, spec, output = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    random.seed(spec["seed"])
    rows = []
    for env_name, variant, splits, num_samples in spec["environments"]:
        namespace, server_name = env_name.split("/", 1)
        for split in splits:
            cap = num_samples or spec["max_tasks"]
            tasks, server_env = list_tasks(base, variant, split)
            random.shuffle(tasks)
            if cap is not None:
                tasks = tasks[:cap]
            for task_spec in tasks:
                spec_hash = hashlib.sha256(
                    json.dumps(task_spec, sort_keys=True).encode()).hexdigest()[:16]
                rows.append({
                    "prompt": f"[{env_name}:{split}:{spec_hash}]",
                    "label": "",
                    "metadata": json.dumps({
                        "env_name": env_name,
                        "deployment_name": env_name,
                        "server_name": server_name,
                        "environment_name": server_env,
                        "namespace": namespace,
                        "split": split,
                        "task_spec": task_spec,
                        "task_hash": spec_hash,
                    }),
                })
    random.shuffle(rows)
    with open(output, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
