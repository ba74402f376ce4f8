#!/usr/bin/env python3
"""Fails when the modules of a crate form a circle.

Every crate of the workspace (a folder with a Cargo.toml and src/) is read from its roots
(src/lib.rs, src/main.rs, src/bin/*.rs) along its `mod` declarations. A module depends on
another when its code names a path into it: `use crate::a::b`, `super::x::Y`, a path in an
expression or type. Comments, strings and `#[cfg(test)]` modules do not count (tests may
reach anywhere, as dev-dependencies may reach up in check_layers.py).

A dependency between two modules counts between the two siblings that contain them, under
their nearest common parent: `crate::trainer -> crate::export::checkpoint` is the arrow
`trainer -> export` among the children of the crate root. A parent's own items (the code
in its file) are one more node among its children, named after the file: a child that uses
`super::Helper` while the parent's code calls into that child is a circle. A parent that
only declares and re-exports its children (`mod x; pub use x::Y;`) is the module tree
itself, and a path through a re-export (`crate::Y`) counts as a path to where `Y` lives.
So a circle is a set of siblings that reach each other, directly or through others: one
of them cannot be understood, tested or moved without the others.

usage: check_modules.py [--root DIR] [--no-allow-list]
"""
import argparse
import os
import re
import sys

# Circles known and left for now, by crate folder: each entry is the set of sibling modules
# (paths under the crate root) that form one circle, with why it stays. The check passes on
# exactly these circles and fails on any other; an entry that no longer matches is
# reported so that it can be deleted.
ALLOWED = {
    # cluster.rs and trainer_ranks.rs both implement TrainerSection (the cluster schema's
    # split into schema / validation / placement removes it).
    "crates/config": [{"cluster", "trainer_ranks"}],
    # transformer.rs holds the layers that paged.rs and invariant.rs build on, and calls
    # both (the model's split into layers / causal LM / paged removes it).
    "crates/model": [{"transformer::<own items>", "transformer::decode_kernels", "transformer::invariant", "transformer::mlp", "transformer::paged"}],
    # Not yet taken apart: the engine's SGLang client keeps its NCCL feed and its process
    # launcher as `impl Inner` blocks and errors of the parent module.
    "crates/engine": [{"sglang::<own items>", "sglang::nccl", "sglang::process"}],
    # The worker-side services of rollout, trainer and weights each call the others'
    # handles (weights need both ends; rank 0 rollouts need the remote trainer).
    "actors/hosting": [{"rollout", "trainer", "weights"}],
}

SKIP_DIRS = {"target", ".git", ".venv", "node_modules"}
IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


def strip_code(text):
    """The source with comments, string and char literals blanked (newlines kept)."""
    out, i, n = [], 0, len(text)

    def blank(s):
        return "".join(c if c == "\n" else " " for c in s)

    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(blank(text[i:j]))
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(blank(text[i:j]))
            i = j
        elif re.match(r'b?r#*"', text[i:i + 40]) and (i == 0 or not re.match(r"\w", text[i - 1])):
            m = re.match(r'b?r(#*)"', text[i:])
            end = text.find('"' + m.group(1), i + m.end())
            j = n if end < 0 else end + 1 + len(m.group(1))
            out.append(blank(text[i:j]))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(blank(text[i:j + 1]))
            i = j + 1
        elif c == "'":
            m = re.match(r"'(\\.[^']*|[^\\'])'", text[i:])
            if m:
                out.append(blank(m.group(0)))
                i += m.end()
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def expand_use_tree(tree):
    """`a::{b, c::{d, e as f}}` -> [("a::b", "b"), ("a::c::d", "d"), ("a::c::e", "f")]
    (a glob names its module; `self` in braces names the prefix)."""
    tree = re.sub(r"\s+as\s+(" + IDENT + ")", r"@\1", tree)
    tree = re.sub(r"\s+", "", tree)
    paths = []

    def walk(prefix, s):
        depth, start, parts = 0, 0, []
        for k, ch in enumerate(s):
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            elif ch == "," and depth == 0:
                parts.append(s[start:k])
                start = k + 1
        parts.append(s[start:])
        for part in parts:
            if not part:
                continue
            brace = part.find("{")
            if brace >= 0 and part.endswith("}"):
                head = part[:brace].rstrip(":")
                walk(prefix + [h for h in head.split("::") if h], part[brace + 1:-1])
            else:
                part, _, alias = part.partition("@")
                segs = [p for p in part.split("::") if p and p not in ("*", "self")]
                full = prefix + segs
                if full:
                    paths.append(("::".join(full), alias or full[-1]))

    walk([], tree)
    return paths


SELF = "<own items>"


class Crate:
    """The module tree of one crate root, the paths each module names, its re-exports."""

    def __init__(self, folder, root_file):
        self.folder = folder
        self.modules = {}  # module path (tuple) -> file
        self.refs = []  # (from module, path segments as written, file, line)
        self.reexports = {}  # module -> {name: (path segments as written)}
        self.names = {}  # module -> {identifier its own code mentions: first (file, line)}
        self.read(root_file, (), top=True)
        # A re-export also brings its name into the module's scope: the module's own code
        # naming it uses the module it comes from.
        for module, exported in self.reexports.items():
            for alias, segs in exported.items():
                if alias in self.names.get(module, {}):
                    path, line = self.names[module][alias]
                    self.refs.append((module, segs, path, line))

    def read(self, path, module, top=False):
        try:
            with open(path, encoding="utf-8") as f:
                text = strip_code(f.read())
        except OSError as e:
            sys.exit(f"modules: {path}: {e}")
        self.modules[module] = path
        is_dir_owner = top or os.path.basename(path) == "mod.rs"
        base = os.path.dirname(path) if is_dir_owner else os.path.splitext(path)[0]
        token = re.compile(
            r"#\s*\[\s*cfg\s*\(\s*test\s*\)\s*\]|\bmod\s+(" + IDENT + r")\s*([{;])|[{};]|"
            r"(\bpub\s*(?:\([^)]*\))?\s*)?\buse\s+([^;]+);|"
            r"(?<![:\w])(" + IDENT + r"(?:\s*::\s*" + IDENT + r")+)|\b(" + IDENT + r")\b")
        stack = [(module, False)]  # (module, is test) per open brace
        pending_test = False
        for m in token.finditer(text):
            tok = m.group(0)
            line = text.count("\n", 0, m.start()) + 1
            cur, in_test = stack[-1]
            if tok.startswith("#"):
                pending_test = True
                continue
            if m.group(1):
                name, opener = m.group(1), m.group(2)
                child = cur + (name,)
                test = in_test or pending_test
                pending_test = False
                if opener == "{":
                    stack.append((child, test))
                    if not test:
                        self.modules.setdefault(child, path)
                elif not test and cur == module:
                    for cand in (os.path.join(base, name + ".rs"),
                                 os.path.join(base, name, "mod.rs")):
                        if os.path.exists(cand):
                            self.read(cand, child)
                            break
                    else:
                        sys.exit(f"modules: {path}:{line}: `mod {name};` has no file")
                continue
            if tok == "{":
                stack.append((cur, in_test))
                pending_test = False
            elif tok == "}":
                if len(stack) > 1:
                    stack.pop()
            elif tok == ";":
                pending_test = False
            elif m.group(4) is not None:
                pending_test = False
                if in_test:
                    continue
                tree = m.group(4)
                for full, alias in expand_use_tree(tree):
                    segs = full.split("::")
                    if m.group(3):  # a re-export: the facade, not a use
                        self.reexports.setdefault(cur, {})[alias] = segs
                    else:
                        self.refs.append((cur, segs, path, line))
            elif m.group(5) and not in_test:
                self.refs.append((cur, re.sub(r"\s+", "", m.group(5)).split("::"), path, line))
            elif m.group(6) and not in_test:
                self.names.setdefault(cur, {}).setdefault(m.group(6), (path, line))

    def resolve(self, cur, segs, hops=0):
        """The module a path names (its longest prefix that is a module, through
        re-exports), or None for a path outside the crate."""
        if segs[0] == "crate":
            base, rest = (), segs[1:]
        elif segs[0] in ("super", "self"):
            base, k = cur, 0
            while k < len(segs) and segs[k] in ("super", "self"):
                if segs[k] == "super":
                    if not base:
                        return None
                    base = base[:-1]
                k += 1
            rest = segs[k:]
        elif cur + (segs[0],) in self.modules:
            base, rest = cur, segs  # a child by its bare name
        else:
            return None  # an external crate or a local item
        target = base
        for k, s in enumerate(rest):
            if s == "self":
                continue
            if target + (s,) in self.modules:
                target = target + (s,)
                continue
            via = self.reexports.get(target, {}).get(s)
            if via is not None and hops < 8:
                found = self.resolve(target, via, hops + 1)
                if found is not None:
                    return found
            break
        return target

    def sibling_edges(self):
        """{parent: {(a, b): (file, line)}}: arrows between siblings a -> b under parent,
        where SELF stands for the parent's own items."""
        edges = {}
        for cur, segs, path, line in self.refs:
            target = self.resolve(cur, segs)
            if target is None or target == cur:
                continue
            k = 0
            while k < min(len(cur), len(target)) and cur[k] == target[k]:
                k += 1
            parent = cur[:k]
            a = cur[k] if k < len(cur) else SELF
            b = target[k] if k < len(target) else SELF
            edges.setdefault(parent, {}).setdefault((a, b), (path, line))
        return edges


def circles(edges):
    """Strongly connected sets of more than one node (Tarjan), each sorted."""
    graph = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def crate_roots(root):
    """(folder relative to root, root file) for every crate root under root."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        if "Cargo.toml" not in filenames or not os.path.isdir(os.path.join(dirpath, "src")):
            continue
        folder = os.path.relpath(dirpath, root)
        src = os.path.join(dirpath, "src")
        for name in ("lib.rs", "main.rs"):
            if os.path.exists(os.path.join(src, name)):
                found.append((folder, os.path.join(src, name)))
        bins = os.path.join(src, "bin")
        if os.path.isdir(bins):
            for name in sorted(os.listdir(bins)):
                p = os.path.join(bins, name)
                if name.endswith(".rs"):
                    found.append((folder, p))
                elif os.path.exists(os.path.join(p, "main.rs")):
                    found.append((folder, os.path.join(p, "main.rs")))
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", help="the workspace (default: this repository)")
    ap.add_argument("--no-allow-list", action="store_true",
                    help="report the allowed circles too (the list is for this repository)")
    args = ap.parse_args()
    root = args.root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    allowed = {} if args.no_allow_list else ALLOWED
    problems, used, roots = [], set(), crate_roots(root)
    for folder, root_file in roots:
        crate = Crate(folder, root_file)
        for parent, edges in sorted(crate.sibling_edges().items()):
            for comp in circles(edges):
                names = {"::".join(parent + (c,)) for c in comp}
                if names in allowed.get(folder, []):
                    used.add((folder, frozenset(names)))
                    continue
                where = "the crate root" if not parent else "::".join(parent)
                own = os.path.relpath(crate.modules[parent], root)
                shown = ", ".join(own if c == SELF else c for c in comp)
                lines = [f"{folder}, under {where}: modules {shown} form a circle:"]
                for (a, b), (path, line) in sorted(edges.items()):
                    if a in comp and b in comp:
                        a, b = (own if x == SELF else x for x in (a, b))
                        lines.append(f"    {a} -> {b}  ({os.path.relpath(path, root)}:{line})")
                problems.append("\n".join(lines))
    for folder, sets in allowed.items():
        for names in sets:
            if (folder, frozenset(names)) not in used:
                print(f"modules: allowed circle {folder}: {sorted(names)} is gone; "
                      "delete it from ALLOWED", file=sys.stderr)
    for p in problems:
        print(f"modules: {p}", file=sys.stderr)
    if problems:
        sys.exit(1)
    print(f"modules: {len(roots)} crate roots, no circle of modules"
          + (f" ({len(used)} allowed)" if used else ""))


if __name__ == "__main__":
    main()
