"""Copies the test executables a `cargo test --no-run --message-format=json` build reports
(read from stdin) into DIR, named after their target (a crate's unit tests as
<crate>_lib), and prints each path. Used by bench/run_gpu_tests.sh and bench/pack_bin.sh.

usage: cargo test --release --no-run --message-format=json ... | python3 copy_test_executables.py DIR
"""
import json
import os
import shutil
import sys


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__.strip().splitlines()[-1])
    out = sys.argv[1]
    for line in sys.stdin:
        m = json.loads(line)
        if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
            t = m["target"]
            name = t["name"] + "_lib" if t["kind"] == ["lib"] else t["name"]
            dest = os.path.join(out, name)
            shutil.copy(m["executable"], dest)
            print(dest)


if __name__ == "__main__":
    main()
