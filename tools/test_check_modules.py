#!/usr/bin/env python3
"""check_modules.py fails on a circle of sibling modules (direct, through a subtree, through
a parent's own items or a re-export) and passes a module tree without one; comments,
strings and test modules do not count (small crates written to a temporary folder)."""
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def run(files):
    """check_modules.py over one crate `c` made of `files` (path under src/ -> text)."""
    with tempfile.TemporaryDirectory() as d:
        crate = os.path.join(d, "crates", "c")
        for rel, text in {"../Cargo.toml": "[package]\nname = \"c\"\n", **files}.items():
            path = os.path.normpath(os.path.join(crate, "src", rel))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        return subprocess.run([sys.executable, os.path.join(HERE, "check_modules.py"),
                               "--root", d, "--no-allow-list"], capture_output=True, text=True)


def fails_with(files, *needles):
    out = run(files)
    assert out.returncode == 1, f"expected a circle: {out.stdout}{out.stderr}"
    for n in needles:
        assert n in out.stderr, f"{n!r} not in: {out.stderr}"


def passes(files):
    out = run(files)
    assert out.returncode == 0, out.stderr
    assert "no circle" in out.stdout, out.stdout


def main():
    lib = "pub mod a;\npub mod b;\n"
    # a one-way arrow, a child naming its parent's items, the parent re-exporting children
    passes({"lib.rs": lib + "pub use a::A;\npub struct E;\n",
            "a.rs": "use crate::b::B;\nuse crate::E;\npub struct A(B, E);\n",
            "b.rs": "pub struct B;\n"})
    # two siblings naming each other
    fails_with({"lib.rs": lib, "a.rs": "pub struct A;\nfn f(_: crate::b::B) {}\n",
                "b.rs": "use super::a::A;\npub struct B(A);\n"},
               "modules a, b form a circle", "a -> b  (crates/c/src/a.rs:2)",
               "b -> a  (crates/c/src/b.rs:1)")
    # grouped and aliased imports, and a path through the root's re-export
    fails_with({"lib.rs": lib + "pub use b::B;\n",
                "a.rs": "use crate::{B as Bee};\npub struct A;\n",
                "b.rs": "use crate::{a::{self, A}};\npub struct B(A);\n"},
               "modules a, b form a circle")
    # a circle between subtrees counts between the siblings that hold them
    fails_with({"lib.rs": lib, "a/mod.rs": "pub mod deep;\n",
                "a/deep.rs": "use crate::b::B;\npub struct D(B);\n",
                "b.rs": "pub struct B(crate::a::deep::D);\n"},
               "modules a, b form a circle", "a -> b  (crates/c/src/a/deep.rs:1)")
    # a parent's own code calling a child that uses the parent's items
    fails_with({"lib.rs": "mod a;\npub struct E;\nfn g() { a::f(); }\n",
                "a.rs": "pub fn f() -> super::E { super::E }\n"},
               "modules crates/c/src/lib.rs, a form a circle")
    # the same through a name the parent re-exports and then uses itself
    fails_with({"lib.rs": "mod a;\npub use a::F;\npub struct E;\nfn g(_: F) {}\n",
                "a.rs": "pub struct F(crate::E);\n"},
               "form a circle")
    # comments, strings and #[cfg(test)] modules do not count
    passes({"lib.rs": lib,
            "a.rs": "// crate::b::B\n/* use crate::b; */\nconst S: &str = \"crate::b::B\";\n"
                    "const R: &str = r#\"crate::b\"#;\nconst C: char = '\"';\n"
                    "#[cfg(test)]\nmod tests {\n    use crate::b::B;\n}\npub struct A;\n",
            "b.rs": "use crate::a::A;\npub struct B(A);\n"})
    # a missing module file is an error that names it
    out = run({"lib.rs": "mod gone;\n"})
    assert out.returncode == 1 and "`mod gone;` has no file" in out.stderr, out.stderr
    print("check_modules: 8 cases passed")


if __name__ == "__main__":
    main()
