#!/usr/bin/env python3
"""Fails when a crate declares a dependency that its code never names.

A dependency counts as used when a Rust source of the crate names it as a path
(`name::`, `use name`, `extern crate name`), with
`-` read as `_` and a `package = ` rename read by its key. Which sources count:
normal dependencies, every `.rs` file outside `tests/`, `benches/`, `examples/` and
`build.rs`; dev-dependencies, every `.rs` file of the crate; build-dependencies,
`build.rs`. Lines that are comments (`//`, `///`, `//!`) do not count. A dependency
that is needed without being named (generated code, a `links` crate for its build
metadata) is listed, with the reason beside it in Cargo.toml, under
`[package.metadata.cargo-machete] ignored = [...]`, the key cargo-machete reads.
Also fails on a `[workspace.dependencies]` entry that no member uses.

It reads `cargo metadata --no-deps` (no network, no build) and the sources, so it
runs in a second.

usage: check_unused_deps.py [--metadata FILE] [--workspace-toml FILE]
  --metadata FILE        read cargo metadata JSON from FILE instead of running cargo
  --workspace-toml FILE  the workspace's Cargo.toml (default: workspace_root/Cargo.toml)
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tomllib

NOT_NORMAL = ("tests", "benches", "examples")


def rust_files(folder):
    """Every .rs file under `folder` (skipping target/ and hidden folders), relative."""
    out = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = [d for d in dirnames if d != "target" and not d.startswith(".")]
        for name in filenames:
            if name.endswith(".rs"):
                out.append(os.path.relpath(os.path.join(dirpath, name), folder))
    return sorted(out)


def code_lines(path):
    """The file's lines that are not comments."""
    with open(path, encoding="utf-8", errors="replace") as f:
        return [line for line in f if not line.lstrip().startswith("//")]


def used_pattern(ident):
    """A regex matching `ident` used as a crate path in Rust code."""
    i = re.escape(ident)
    return re.compile(rf"(\b{i}\s*::|\buse\s+{i}\b|\bextern\s+crate\s+{i}\b)")


def sources_for(kind, files):
    """The files (relative to the crate) where a dependency of `kind` may be named."""
    if kind == "build":
        return [f for f in files if f == "build.rs"]
    if kind == "dev":
        return files
    return [f for f in files if f != "build.rs" and f.split(os.sep)[0] not in NOT_NORMAL]


def unused(metadata):
    """(problems, members checked, dependencies checked)."""
    members = set(metadata["workspace_members"])
    problems, crates, deps = [], 0, 0
    for pkg in metadata["packages"]:
        if pkg["id"] not in members:
            continue
        crates += 1
        folder = os.path.dirname(pkg["manifest_path"])
        files = rust_files(folder)
        texts = {f: "".join(code_lines(os.path.join(folder, f))) for f in files}
        meta = (pkg.get("metadata") or {}).get("cargo-machete") or {}
        ignored = set(meta.get("ignored", []))
        for name in sorted(ignored):
            if not any(d["name"] == name or d.get("rename") == name for d in pkg["dependencies"]):
                problems.append(f"{pkg['manifest_path']}: ignored dependency {name!r} is not declared")
        for dep in pkg["dependencies"]:
            key = dep.get("rename") or dep["name"]
            if key in ignored or dep["name"] in ignored:
                continue
            deps += 1
            kind = dep.get("kind") or "normal"
            pattern = used_pattern(key.replace("-", "_"))
            where = sources_for(kind, files)
            if not any(pattern.search(texts[f]) for f in where):
                section = {"normal": "dependencies", "dev": "dev-dependencies",
                           "build": "build-dependencies"}[kind]
                problems.append(f"{pkg['manifest_path']}: [{section}] {key} is never used "
                                f"(searched {len(where)} files); remove it, or list it under "
                                "[package.metadata.cargo-machete] ignored with the reason")
    return problems, crates, deps


def unused_in_workspace(workspace_toml, metadata):
    """`[workspace.dependencies]` entries that no member declares."""
    with open(workspace_toml, "rb") as f:
        declared = tomllib.load(f).get("workspace", {}).get("dependencies", {})
    members = set(metadata["workspace_members"])
    wanted = set()
    for pkg in metadata["packages"]:
        if pkg["id"] in members:
            for dep in pkg["dependencies"]:
                wanted.add(dep.get("rename") or dep["name"])
                wanted.add(dep["name"])
    return [f"{workspace_toml}: [workspace.dependencies] {name} is used by no member"
            for name in sorted(declared) if name not in wanted]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--metadata")
    ap.add_argument("--workspace-toml")
    args = ap.parse_args()
    if args.metadata:
        with open(args.metadata, encoding="utf-8") as f:
            metadata = json.load(f)
    else:
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        out = subprocess.run(["cargo", "metadata", "--no-deps", "--format-version", "1"],
                             cwd=here, check=True, capture_output=True, text=True).stdout
        metadata = json.loads(out)
    workspace_toml = args.workspace_toml or os.path.join(metadata["workspace_root"], "Cargo.toml")
    problems, crates, deps = unused(metadata)
    problems += unused_in_workspace(workspace_toml, metadata)
    for p in problems:
        print(f"unused dependencies: {p}", file=sys.stderr)
    if problems:
        sys.exit(1)
    print(f"unused dependencies: none ({deps} dependencies of {crates} crates checked)")


if __name__ == "__main__":
    main()
