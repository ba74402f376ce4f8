#!/usr/bin/env bash
# Offline install of the TRL bundle made by bench/trl/pack.sh, on the GPU machine (no network).
# Usage: bash bench/trl/install.sh TARBALL [SITE]
#   TARBALL  trl_wheels.tar.xz; a SHA256SUMS beside it is checked when present
#   SITE     target folder, default $TRL_SITE or /tmp/trl_site; wiped and re-made. The wheels go
#            into SITE/site-packages (SITE itself when its path already holds "site-packages"):
#            dill, which datasets uses to fingerprint tables, pickles a module by reference only
#            when its file's path holds "site-packages" (or the interpreter's prefix); from a plain
#            --target folder it pickles pyarrow by value and Dataset.from_dict fails with
#            "Can't pickle <class 'MonthDayNano'>".
# It installs (pip --no-index --no-deps --target SITE/site-packages) TRL and, of the other carried wheels,
# only those that python3's environment lacks or has at a version TRL's requirements
# (walked through the carried wheels' metadata) do not accept; TRL_INSTALL_ALL=1 installs
# every carried wheel. It stops, naming them, when a requirement is met neither by the
# machine nor by the bundle (then repack, e.g. WITH_ARROW=1 bash bench/trl/pack.sh DIR).
# Afterwards:  source SITE/trl_env.sh   (PYTHONPATH=SITE/site-packages first, and HF_HUB_OFFLINE=1
# with the other offline switches; bench/py/trl_grpo_step.py sets those itself too).
set -euo pipefail
[ $# -ge 1 ] && [ $# -le 2 ] || { echo "usage: bash bench/trl/install.sh TARBALL [SITE]" >&2; exit 2; }
TARBALL=$1
SITE=${2:-${TRL_SITE:-/tmp/trl_site}}
PY=${PYTHON:-python3}
[ -f "$TARBALL" ] || { echo "[trl-install] ERROR: no bundle at $TARBALL (make it here with bench/trl/pack.sh and carry it)" >&2; exit 1; }
TDIR=$(cd "$(dirname "$TARBALL")" && pwd); TNAME=$(basename "$TARBALL")
if [ -f "$TDIR/SHA256SUMS" ] && grep -q " \*\?$TNAME\$" "$TDIR/SHA256SUMS"; then
  (cd "$TDIR" && grep " \*\?$TNAME\$" SHA256SUMS | sha256sum -c --quiet -) \
    || { echo "[trl-install] ERROR: $TARBALL does not match $TDIR/SHA256SUMS" >&2; exit 1; }
  echo "[trl-install] checksum OK"
else
  echo "[trl-install] no SHA256SUMS entry beside $TARBALL; checking the wheels' own sums only"
fi

W=$(mktemp -d /tmp/trl_wheels.XXXX); trap 'rm -rf "$W"' EXIT
tar -C "$W" -xJf "$TARBALL"
D="$W/trl_wheels"
[ -f "$D/MANIFEST.tsv" ] && [ -f "$D/roots.txt" ] || { echo "[trl-install] ERROR: $TARBALL is not a pack.sh bundle (no MANIFEST.tsv)" >&2; exit 1; }
while IFS=$'\t' read -r _ _ file sum _; do
  echo "$sum  $D/$file"
done < "$D/MANIFEST.tsv" | sha256sum -c --quiet - || { echo "[trl-install] ERROR: a wheel does not match MANIFEST.tsv" >&2; exit 1; }
echo "[trl-install] bundle: $(cat "$D/PACKED_FOR"); $(wc -l < "$D/MANIFEST.tsv") wheels"

# Choose the wheels. Runs without SITE on the path, so it sees the machine's own packages.
env -u PYTHONPATH "$PY" - "$D" > "$W/pick.txt" <<'PY' || { echo "[trl-install] ERROR: choosing the wheels failed (see above)" >&2; exit 1; }
import importlib.metadata as md, os, re, sys, zipfile
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.version import Version

d = sys.argv[1]
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
carried = {}  # name -> (version, wheel path, [Requirement])
for line in open(os.path.join(d, "MANIFEST.tsv")):
    name, ver, fname = line.rstrip("\n").split("\t")[:3]
    path = os.path.join(d, fname)
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    reqs = [Requirement(l.split(":", 1)[1].strip()) for l in text.splitlines() if l.startswith("Requires-Dist:")]
    carried[norm(name)] = (Version(ver), path, reqs)
env = default_environment()
env["extra"] = ""

def installed(name):
    try:
        return Version(md.version(name))
    except md.PackageNotFoundError:
        return None

roots = [Requirement(l.strip()) for l in open(os.path.join(d, "roots.txt")) if l.strip()]
force_all = os.environ.get("TRL_INSTALL_ALL") == "1"
chosen, specs = {}, {}
changed = True
while changed:
    changed = False
    reqs = [(r, "bundle roots") for r in roots]
    for n in chosen:
        reqs += [(r, n) for r in carried[n][2]]
    specs = {}
    for r, who in reqs:
        if r.marker is not None and not r.marker.evaluate(env):
            continue
        specs.setdefault(norm(r.name), []).append((r, who))
    for n, rs in specs.items():
        if n in chosen:
            continue
        have = installed(n)
        ok = have is not None and all(r.specifier.contains(have, prereleases=True) for r, _ in rs)
        if n in carried and (force_all or not ok or any(w == "bundle roots" for _, w in rs)):
            chosen[n] = True
            changed = True
    if force_all:
        for n in carried:
            if n not in chosen:
                chosen[n] = True
                changed = True

missing = []
for n, rs in specs.items():
    want = " ".join(f"{r} (from {w})" for r, w in rs)
    if n in chosen:
        v = carried[n][0]
        bad = [str(r) for r, _ in rs if not r.specifier.contains(v, prereleases=True)]
        if bad:
            missing.append(f"{n}: carried {v} does not satisfy {', '.join(bad)}")
        print(f"[trl-install] carry   {n} {v}   ({want})", file=sys.stderr)
    else:
        have = installed(n)
        if have is None or not all(r.specifier.contains(have, prereleases=True) for r, _ in rs):
            missing.append(f"{n}: machine has {have or 'nothing'}, bundle has nothing; need {want}")
        else:
            print(f"[trl-install] machine {n} {have}", file=sys.stderr)
if missing:
    print("[trl-install] ERROR: requirements met neither by this machine nor by the bundle:", file=sys.stderr)
    for m in missing:
        print("  " + m, file=sys.stderr)
    print("  (bench/trl/pack.sh packs pyarrow and pandas with WITH_ARROW=1; TRL_INSTALL_ALL=1 takes every "
          "carried wheel over the machine's)", file=sys.stderr)
    sys.exit(1)
for n in chosen:
    print(carried[n][1])
PY
mapfile -t PICK < "$W/pick.txt"
[ ${#PICK[@]} -gt 0 ] || { echo "[trl-install] ERROR: nothing chosen to install" >&2; exit 1; }

case $SITE in *site-packages*) PKGS=$SITE ;; *) PKGS=$SITE/site-packages ;; esac
rm -rf "$SITE"; mkdir -p "$PKGS"
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
  --target "$PKGS" "${PICK[@]}" \
  || { echo "[trl-install] ERROR: pip install into $PKGS failed" >&2; exit 1; }
cat > "$SITE/trl_env.sh" <<ENV
export PYTHONPATH="$PKGS\${PYTHONPATH:+:\$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
ENV
PYTHONPATH="$PKGS${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 "$PY" -c '
import trl, datasets, accelerate, transformers, torch
print("[trl-install] import OK: trl", trl.__version__, "| datasets", datasets.__version__,
      "| accelerate", accelerate.__version__, "| transformers", transformers.__version__, "| torch", torch.__version__)
from trl import GRPOConfig, GRPOTrainer
datasets.Dataset.from_dict({"prompt": ["a"], "target": [1]})  # fingerprints the table with dill
' || { echo "[trl-install] ERROR: trl or datasets does not work from $PKGS" >&2; exit 1; }
echo "[trl-install] installed ${#PICK[@]} wheels into $PKGS: $(cd "$PKGS" && ls -d *.dist-info | sed 's/\.dist-info$//' | tr '\n' ' ')"
echo "[trl-install] use:  source $SITE/trl_env.sh     (or PYTHONPATH=$PKGS python3 ...)"
