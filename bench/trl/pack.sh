#!/usr/bin/env bash
# Packs TRL (its GRPOTrainer is the peer in bench/run_trl_step.sh) and the wheels of its
# runtime needs that the GPU machine's image lacks into one OUTDIR/trl_wheels.tar.xz, with
# OUTDIR/SHA256SUMS beside it. Runs here (needs PyPI); the GPU machine is offline.
#
# Usage: bash bench/trl/pack.sh OUTDIR        e.g. OUTDIR=.devpack (git-ignored)
# Then carry OUTDIR/trl_wheels.tar.xz (and SHA256SUMS) to the device and run
#   bash bench/trl/install.sh OUTDIR/trl_wheels.tar.xz      (bench/run_trl_step.sh does it)
#
# What goes in. The image (Python 3.12, torch 2.11.0+cu130, transformers 5.17.0,
# huggingface_hub 1.33, accelerate 1.15.0; /work/.library/device/KINDS.md lists the rest)
# holds every need of TRL but datasets, dill and multiprocess. Those, TRL, and the small
# wheels whose version datasets pins or that the list may not show (fsspec <= 2026.9.0,
# xxhash, tzdata, psutil, accelerate) are always packed: 9 wheels, a 1.8 MiB bundle, ~10 s.
# pyarrow and pandas (datasets needs pyarrow >= 24) are on the image by its list, versions
# unread; WITH_ARROW=1 packs them too (+ python-dateutil): a 38 MiB bundle, ~3.5 minutes of
# xz. install.sh installs only what the machine lacks or has at a version that does not
# satisfy, and names what is missing.
#
# PY_VERSION (default 3.12) picks the wheels' Python; PY_VERSION=3.11 makes a bundle for a
# local test with this machine's Python. Idempotent: a bundle already made from the same
# list is kept (FORCE=1 remakes it); a remade one has the same bytes (sorted names, fixed
# times and owners, single-threaded xz).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
[ $# -eq 1 ] || { echo "usage: bash bench/trl/pack.sh OUTDIR" >&2; exit 2; }
OUT="$(mkdir -p "$1" && cd "$1" && pwd)"
PY_VERSION=${PY_VERSION:-3.12}
WITH_ARROW=${WITH_ARROW:-0}
PIP=${PIP:-python3 -m pip}

# name==version, one group a line; every file must stay one version of each package.
ROOT=(trl==1.16.0)
ALWAYS=(datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 fsspec==2026.9.0 xxhash==4.1.0
        tzdata==2026.6 psutil==7.2.2 accelerate==1.15.0)
ARROW=(pyarrow==26.0.1 pandas==3.1.1 python-dateutil==4.0.0)
SPECS=("${ROOT[@]}" "${ALWAYS[@]}")
[ "$WITH_ARROW" = 1 ] && SPECS+=("${ARROW[@]}")

STAMP="py=$PY_VERSION ${SPECS[*]} pack.sh=$(sha256sum "$HERE/pack.sh" | cut -c1-16)"
TARBALL="$OUT/trl_wheels.tar.xz"
if [ "${FORCE:-0}" != 1 ] && [ -f "$TARBALL" ] && [ -f "$OUT/SHA256SUMS" ] && [ -f "$OUT/trl_wheels.stamp" ] \
   && [ "$(cat "$OUT/trl_wheels.stamp")" = "$STAMP" ] && (cd "$OUT" && sha256sum -c --quiet SHA256SUMS); then
  echo "[trl-pack] $TARBALL is up to date ($(du -k "$TARBALL" | cut -f1) KiB); FORCE=1 remakes it"
  exit 0
fi

W=$(mktemp -d /tmp/trlpack.XXXX); trap 'rm -rf "$W"' EXIT
D="$W/trl_wheels"; mkdir -p "$D"
plat=""
for p in 2_39 2_35 2_34 2_31 2_28 2_27 2_24 2_18 2_17 2_12 2_5; do plat="$plat --platform manylinux_${p}_x86_64"; done
plat="$plat --platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64"
for spec in "${SPECS[@]}"; do
  # shellcheck disable=SC2086
  $PIP download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
    $plat -d "$D" "$spec" \
    || { echo "[trl-pack] ERROR: no wheel of $spec for CPython $PY_VERSION manylinux x86_64" >&2; exit 1; }
done
n=$(ls "$D"/*.whl | wc -l)
[ "$n" -eq ${#SPECS[@]} ] || { echo "[trl-pack] ERROR: $n wheels for ${#SPECS[@]} specs (two versions of one package?)" >&2; ls "$D" >&2; exit 1; }

# Wheels are deflated zips, which xz cannot shrink further: rewrite each with its members
# stored (same names, bytes, times and RECORD, so pip installs it as before) and let xz
# compress the whole tar. pyarrow's 52 MiB wheel goes to about 30 MiB this way.
python3 - "$D"/*.whl <<'PY'
import os, sys, zipfile
for path in sys.argv[1:]:
    tmp = path + ".stored"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            out = zipfile.ZipInfo(info.filename, info.date_time)
            out.external_attr, out.create_system = info.external_attr, info.create_system
            dst.writestr(out, src.read(info), zipfile.ZIP_STORED)
    os.replace(tmp, path)
PY

# MANIFEST.tsv: name, version, file, sha256, size; roots.txt: what install.sh resolves from.
(cd "$D" && for w in *.whl; do
  name=${w%%-*}; rest=${w#*-}; ver=${rest%%-*}
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$ver" "$w" "$(sha256sum "$w" | cut -d' ' -f1)" "$(stat -c %s "$w")"
done) | sort > "$D/MANIFEST.tsv"
printf '%s\n' "${ROOT[@]}" > "$D/roots.txt"
echo "py_version=$PY_VERSION with_arrow=$WITH_ARROW" > "$D/PACKED_FOR"
touch -d @0 "$D" "$D"/*

rm -f "$TARBALL" "$OUT/SHA256SUMS" "$OUT/trl_wheels.stamp"
tar -C "$W" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf - trl_wheels \
  | xz -9e -T1 -c > "$W/trl_wheels.tar.xz"
echo "[trl-pack] wheels (CPython $PY_VERSION):"
awk -F'\t' '{printf "  %-60s %8.2f MiB\n", $3, $5/1048576}' "$D/MANIFEST.tsv"
size=$(stat -c %s "$W/trl_wheels.tar.xz")
echo "[trl-pack] wheels $(du -cb "$D"/*.whl | tail -1 | cut -f1 | awk '{printf "%.2f", $1/1048576}') MiB stored;" \
     "trl_wheels.tar.xz $(awk -v s="$size" 'BEGIN{printf "%.2f", s/1048576}') MiB"
[ "$size" -le $((60 * 1024 * 1024)) ] || { echo "[trl-pack] ERROR: the bundle is over 60 MiB; not written" >&2; exit 1; }
mv "$W/trl_wheels.tar.xz" "$TARBALL"
(cd "$OUT" && sha256sum trl_wheels.tar.xz > SHA256SUMS)
echo "$STAMP" > "$OUT/trl_wheels.stamp"
echo "[trl-pack] wrote $TARBALL and $OUT/SHA256SUMS"
