#!/usr/bin/env python3
"""Fails when a workspace crate depends on a crate of a higher layer.

The layers are the table under "## Layers" in docs/architecture.md (rows
`| N | folder, folder, ... | what |`), so the documented order and the checked one
cannot drift apart. Dependencies come from `cargo metadata --no-deps` (normal and
build dependencies; dev-dependencies may reach up, as tests do). A crate may depend on
crates of its own layer or lower ones.

usage: check_layers.py [--metadata FILE] [--layers FILE]
  --metadata FILE  read cargo metadata JSON from FILE instead of running cargo
  --layers FILE    the markdown file holding the table (default docs/architecture.md)
"""
import argparse
import json
import os
import re
import subprocess
import sys

ROW = re.compile(r"^\|\s*(\d+)\s*\|([^|]+)\|")


def read_layers(path):
    """Folder (relative to the workspace root) -> layer number, from the Layers table."""
    layers, in_section = {}, False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("## "):
                in_section = line.strip() == "## Layers"
                continue
            m = ROW.match(line) if in_section else None
            if m:
                for folder in m.group(2).split(","):
                    folder = folder.strip().strip("`").rstrip("/")
                    if folder:
                        layers[folder] = int(m.group(1))
    if not layers:
        sys.exit(f"{path}: no '## Layers' table with rows like '| 0 | crates/core, ... | ... |'")
    return layers


def violations(metadata, layers):
    """(problems, checked): every crate without a layer, every dependency that reaches up."""
    root = metadata["workspace_root"]
    members = set(metadata["workspace_members"])
    folder_of, problems = {}, []
    for pkg in metadata["packages"]:
        if pkg["id"] in members:
            folder_of[pkg["name"]] = os.path.relpath(os.path.dirname(pkg["manifest_path"]), root)
    for name, folder in sorted(folder_of.items()):
        if folder not in layers:
            problems.append(f"{name} ({folder}) is in no layer of the Layers table")
    for pkg in metadata["packages"]:
        if pkg["id"] not in members or folder_of[pkg["name"]] not in layers:
            continue
        own = layers[folder_of[pkg["name"]]]
        for dep in pkg["dependencies"]:
            if dep["name"] not in folder_of or dep.get("kind") == "dev":
                continue
            dep_folder = folder_of[dep["name"]]
            theirs = layers.get(dep_folder)
            if theirs is not None and theirs > own:
                problems.append(
                    f"{pkg['name']} ({folder_of[pkg['name']]}, layer {own}) depends on "
                    f"{dep['name']} ({dep_folder}, layer {theirs}): an arrow up the layers")
    return problems, len(folder_of)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--metadata")
    ap.add_argument("--layers")
    args = ap.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    layers = read_layers(args.layers or os.path.join(here, "docs", "architecture.md"))
    if args.metadata:
        with open(args.metadata, encoding="utf-8") as f:
            metadata = json.load(f)
    else:
        out = subprocess.run(["cargo", "metadata", "--no-deps", "--format-version", "1"],
                             cwd=here, check=True, capture_output=True, text=True).stdout
        metadata = json.loads(out)
    problems, checked = violations(metadata, layers)
    for p in problems:
        print(f"layers: {p}", file=sys.stderr)
    if problems:
        sys.exit(1)
    print(f"layers: {checked} crates, no dependency reaches up a layer")


if __name__ == "__main__":
    main()
