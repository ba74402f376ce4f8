#!/usr/bin/env python3
"""check_layers.py fails on an upward dependency and on a crate with no layer, and
passes a layering that holds (fake cargo metadata, so it runs without cargo)."""
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
TABLE = """# x

## Layers

| layer | folders | what |
|---|---|---|
| 0 | `crates/a` | bottom |
| 1 | `actors/b`, `actors/c` | top |

## Other
| 9 | `not/a/layer` | ignored: outside the section |
"""


def metadata(root, deps):
    pkgs = []
    for name, folder in [("a", "crates/a"), ("b", "actors/b"), ("c", "actors/c")]:
        pkgs.append({"id": name, "name": name,
                     "manifest_path": os.path.join(root, folder, "Cargo.toml"),
                     "dependencies": [{"name": d, "kind": k} for d, k in deps.get(name, [])]})
    return {"workspace_root": root, "workspace_members": [p["id"] for p in pkgs], "packages": pkgs}


def run(deps, table=TABLE):
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "layers.md"), "w") as f:
            f.write(table)
        with open(os.path.join(d, "meta.json"), "w") as f:
            json.dump(metadata("/ws", deps), f)
        return subprocess.run([sys.executable, os.path.join(HERE, "check_layers.py"),
                               "--metadata", os.path.join(d, "meta.json"),
                               "--layers", os.path.join(d, "layers.md")],
                              capture_output=True, text=True)


def main():
    ok = run({"b": [("a", None), ("c", None)], "a": [("b", "dev")]})
    assert ok.returncode == 0, ok.stderr
    up = run({"a": [("b", None)]})
    assert up.returncode == 1 and "a (crates/a, layer 0) depends on b (actors/b, layer 1)" in up.stderr, up.stderr
    build_up = run({"a": [("c", "build")]})
    assert build_up.returncode == 1 and "depends on c" in build_up.stderr, build_up.stderr
    missing = run({}, TABLE.replace(", `actors/c`", ""))
    assert missing.returncode == 1 and "c (actors/c) is in no layer" in missing.stderr, missing.stderr
    print("check_layers: 4 cases passed")


if __name__ == "__main__":
    main()
