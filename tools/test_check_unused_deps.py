#!/usr/bin/env python3
"""check_unused_deps.py passes a crate whose dependencies are all named where their kind
allows, and fails on one named only in a comment, a normal dependency named only by
tests, a stale ignore entry and an unused workspace dependency (fake cargo metadata and
sources in a temporary folder, so it runs without cargo)."""
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))

SOURCES = {
    "src/lib.rs": "//! Docs naming commented_out::Thing do not count.\n"
                  "use serde_json::Value;\nuse tch;\npub fn f() { renamed_dep::go(); }\n",
    "src/inner/mod.rs": "#[tokio::main]\nasync fn main() {}\n",
    "tests/t.rs": "use tempfile::tempdir;\nfn t() { only_in_tests::x(); }\n",
    "build.rs": "fn main() { cc_helper::run(); }\n",
    "target/debug/junk.rs": "use unused_dep::x;\n",
}


def dep(name, kind=None, rename=None):
    return {"name": name, "kind": kind, "rename": rename}


def run(deps, ignored=(), workspace_deps=("serde_json",)):
    with tempfile.TemporaryDirectory() as root:
        crate = os.path.join(root, "crates", "a")
        for rel, text in SOURCES.items():
            path = os.path.join(crate, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
        pkg = {"id": "a", "name": "a", "manifest_path": os.path.join(crate, "Cargo.toml"),
               "dependencies": deps,
               "metadata": {"cargo-machete": {"ignored": list(ignored)}} if ignored else None}
        meta = {"workspace_root": root, "workspace_members": ["a"], "packages": [pkg]}
        with open(os.path.join(root, "meta.json"), "w") as f:
            json.dump(meta, f)
        with open(os.path.join(root, "Cargo.toml"), "w") as f:
            f.write("[workspace]\nmembers = ['crates/a']\n[workspace.dependencies]\n")
            f.writelines(f'{d} = "1"\n' for d in workspace_deps)
        return subprocess.run([sys.executable, os.path.join(HERE, "check_unused_deps.py"),
                               "--metadata", os.path.join(root, "meta.json")],
                              capture_output=True, text=True)


GOOD = [dep("serde_json"), dep("tch"), dep("tokio"), dep("renamed-crate", rename="renamed_dep"),
        dep("tempfile", "dev"), dep("only-in-tests", "dev"), dep("cc-helper", "build"),
        dep("torch-sys")]


def main():
    ok = run(GOOD, ignored=["torch-sys"])
    assert ok.returncode == 0, ok.stderr
    assert "7 dependencies of 1 crates" in ok.stdout, ok.stdout

    not_ignored = run(GOOD)
    assert not_ignored.returncode == 1 and "[dependencies] torch-sys is never used" in not_ignored.stderr, \
        not_ignored.stderr

    comment = run(GOOD + [dep("commented-out")], ignored=["torch-sys"])
    assert comment.returncode == 1 and "[dependencies] commented-out is never used" in comment.stderr, \
        comment.stderr

    tests_only = run([d for d in GOOD if d["name"] != "only-in-tests"] + [dep("only-in-tests")],
                     ignored=["torch-sys"])
    assert tests_only.returncode == 1 and "[dependencies] only-in-tests" in tests_only.stderr, \
        tests_only.stderr

    build_only = run(GOOD + [dep("tempfile", "build")], ignored=["torch-sys"])
    assert build_only.returncode == 1 and "[build-dependencies] tempfile" in build_only.stderr, \
        build_only.stderr

    in_target = run(GOOD + [dep("unused-dep")], ignored=["torch-sys"])
    assert in_target.returncode == 1 and "unused-dep is never used" in in_target.stderr, in_target.stderr

    stale = run(GOOD, ignored=["torch-sys", "gone"])
    assert stale.returncode == 1 and "ignored dependency 'gone' is not declared" in stale.stderr, stale.stderr

    ws = run(GOOD, ignored=["torch-sys"], workspace_deps=("serde_json", "h2"))
    assert ws.returncode == 1 and "[workspace.dependencies] h2 is used by no member" in ws.stderr, ws.stderr
    assert "serde_json" not in ws.stderr, ws.stderr
    print("check_unused_deps: 8 cases passed")


if __name__ == "__main__":
    main()
