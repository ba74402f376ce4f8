#!/usr/bin/env bash
# Here (no GPU needed): builds the binaries the device-side scripts run, from the committed
# HEAD in a clone of its own (edits in the work tree during the ~5-15 minute build do not leak
# into it), strips them and packs bin/ into .devpack/manta-<commit>.tar.xz (~12 MB with the
# decode test set: inside the device tool's 64 MiB carry, beside an SGLang bundle piece).
#   bash bench/pack_bin.sh                 # driver, otlp_sink, engine_decode, decode_step, paged_attention + tests
# There (carry [".devpack"]):  mkdir -p bin && tar -xJf .devpack/manta-<commit>.tar.xz -C bin
#   (bench/run_trl_step.sh does this itself: MANTA_TARBALL=.devpack/manta-<commit>.tar.xz)
# Env: PACK_TESTS = decode (default: the kernel, model and engine GPU tests that
#   bench/run_gpu_tests.sh runs for decode changes), all (bench/run_gpu_tests.sh build: every
#   GPU test; a larger pack), none. BUILD_DIR (/tmp/manta-devbuild): the clone, whose target/
#   later packs reuse; delete it to free its ~10 GB.
set -euo pipefail
ROOT=$(git rev-parse --show-toplevel)
BUILD_DIR=${BUILD_DIR:-/tmp/manta-devbuild}
PACK_TESTS=${PACK_TESTS:-decode}
case "$PACK_TESTS" in decode|all|none) ;; *) echo "error: PACK_TESTS=$PACK_TESTS: one of decode, all, none" >&2; exit 2;; esac
[ -x "$ROOT/.venv/bin/python" ] || { echo "error: $ROOT/.venv missing: run make setup first (libtorch comes from its torch)" >&2; exit 1; }
[ -d "$BUILD_DIR/.git" ] || git clone -q "$ROOT" "$BUILD_DIR"
git -C "$BUILD_DIR" fetch -q "$ROOT" HEAD
git -C "$BUILD_DIR" checkout -q -f FETCH_HEAD
REV=$(git -C "$BUILD_DIR" rev-parse --short HEAD)
ln -sfn "$ROOT/.venv" "$BUILD_DIR/.venv"
cd "$BUILD_DIR"
export PATH=$ROOT/.venv/bin:$PATH LIBTORCH_USE_PYTORCH=1 CARGO_INCREMENTAL=0
export LD_LIBRARY_PATH=$ROOT/.venv/lib/python3.11/site-packages/torch/lib:${LD_LIBRARY_PATH:-}
rm -rf bin && mkdir -p bin/tests
echo "[pack] building $REV in $BUILD_DIR"
cargo build --release -p manta-driver --bin driver -p manta-bench --bin otlp_sink --bin engine_decode --bin decode_step --bin paged_attention
cp target/release/{driver,otlp_sink,engine_decode,decode_step,paged_attention} bin/
tests() {  # cargo test --no-run ARGS..., each test executable copied to bin/tests
  cargo test --release --no-run --message-format=json "$@" | python3 bench/py/copy_test_executables.py bin/tests > /dev/null
}
case "$PACK_TESTS" in
  decode)
    tests -p manta-cuda --lib --test rope --test rms_norm --test swiglu
    tests -p manta-model --test cuda --test fused_decoder
    tests -p manta-engine --test native_engine_cuda ;;
  all) bash bench/run_gpu_tests.sh build > /dev/null ;;
esac
strip bin/* bin/tests/* 2>/dev/null || true
mkdir -p "$ROOT/.devpack"
tar -cJf "$ROOT/.devpack/manta-$REV.tar.xz" -C bin .
ls -la bin bin/tests
echo "[pack] $ROOT/.devpack/manta-$REV.tar.xz ($(du -h "$ROOT/.devpack/manta-$REV.tar.xz" | cut -f1))"
