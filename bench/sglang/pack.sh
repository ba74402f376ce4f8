#!/usr/bin/env bash
# Packs SGLang 0.5.17 and the wheels the GPU machine lacks (wheels.tsv beside this file) into
# pieces of at most 56 MiB for the device tool (64 MiB a call, the working tree included).
# Runs here, needs network to PyPI, ~1 GB of downloads, ~10 minutes of CPU on 2 cores.
# Usage: bash bench/sglang/pack.sh OUTDIR     (OUTDIR git-ignored, e.g. .whl/sgb)
# Then carry OUTDIR/p00 .. pNN one per device call, back to back (a warm machine keeps /tmp while
# calls follow each other), copying each into /tmp/sgb_parts there; carry SHA256SUMS, z/ and
# install.sh with the last piece and run: bash install.sh /tmp/sgb_parts
# Left out on purpose: nvidia_cutlass_dsl_libs_cu12 (the machine is CUDA 13) and sgl_kernel's FA3
# library flash_ops.abi3.so (1.1 GB): serve with --attention-backend flashinfer or triton.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="$(mkdir -p "${1:?usage: pack.sh OUTDIR}" && cd "$1" && pwd)"
W=$(mktemp -d /tmp/sgbpack.XXXX); trap 'rm -rf "$W"' EXIT
mkdir -p "$W/whl" "$W/site" "$OUT/z"
plat=""; for p in 2_34 2_31 2_28 2_27 2_24 2_17 2_12 2_5; do plat="$plat --platform manylinux_${p}_x86_64"; done
plat="$plat --platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64 --platform any"
awk -F'\t' '{print $2}' "$HERE/wheels.tsv" | grep -v '^nvidia_cutlass_dsl_libs_cu12-' | while read -r f; do
  name=${f%%-*}; rest=${f#*-}; ver=${rest%%-*}
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    $plat -d "$W/whl" "$name==$ver" || { echo "download failed: $name==$ver" >&2; exit 1; }
done
echo "[pack] $(ls "$W/whl" | wc -l) wheels"
for w in "$W"/whl/*.whl; do
  python3 - "$w" "$W/site" <<'PY'
import sys, zipfile, os, shutil
w, site = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(w) as z:
    for info in z.infolist():
        name = info.filename
        parts = name.split("/")
        if parts[0].endswith(".data"):
            if len(parts) > 2 and parts[1] in ("purelib", "platlib"):
                name = "/".join(parts[2:])
            else:
                continue
        if not name or name.endswith("/"):
            continue
        dest = os.path.join(site, name)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        with z.open(info) as src, open(dest, "wb") as dst:
            shutil.copyfileobj(src, dst)
        mode = (info.external_attr >> 16) & 0o777
        if mode:
            os.chmod(dest, mode)
PY
done
find "$W/site" -name flash_ops.abi3.so -path '*sgl_kernel*' -delete
echo "[pack] unpacked $(du -sm "$W/site" | cut -f1) MiB"
rm -f "$OUT"/p[0-9]*
tar -C "$W/site" -cf - . | nice -n 10 zstd -q -T2 -15 --long=27 -c | split -b 56m -d -a 2 - "$OUT/p"
cp "$W"/whl/zstandard-*.whl "$OUT/z/"
cp "$HERE/install.sh" "$OUT/install.sh"
(cd "$OUT" && sha256sum p[0-9]* > SHA256SUMS)
ls -la "$OUT"
