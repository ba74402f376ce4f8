#!/usr/bin/env bash
# Manta's SGLang engine against real SGLang (actors/driver/tests/sglang_real.rs): the
# launch the rollout actor does, health, generation with log-probs, weights over NCCL
# checked bit for bit by SGLang's own /weights_checker against the same weights from
# disk, the retract and abort pauses, and SIGKILL mid-generation. Two GPUs: the
# trainer's side on GPU 0, the server on GPU 1.
#
# Here (no GPU needed):  bench/run_sglang_interop.sh build   # the test binary into bin/tests
# There (device tool, carry ["bin"]), after bench/sglang/install.sh:
#   source /tmp/site/sglang_env.sh; bench/run_sglang_interop.sh
# MODEL_SHAPE (0.6b, default, or 8b) picks the random model's shape; SGLANG_ARGS replaces
# the server's extra flags (default: --attention-backend flashinfer).
set -euo pipefail
if [ "${1:-}" = build ]; then
  mkdir -p bin/tests
  cargo test --release --no-run --message-format=json -p manta-driver --test sglang_real | python3 -c '
import json, shutil, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        shutil.copy(m["executable"], "bin/tests/sglang_real"); print("bin/tests/sglang_real")'
  strip bin/tests/sglang_real
  exit 0
fi
python3 -c 'import sglang' 2>/dev/null || { echo "error: SGLang is not importable: install the bundle of bench/sglang/ and source /tmp/site/sglang_env.sh" >&2; exit 1; }
TL=$(python3 -c 'import torch,os;print(os.path.dirname(torch.__file__))')/lib
export LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SHAPE=${MODEL_SHAPE:-0.6b}
MODEL=/tmp/manta-e2e/qwen3-$SHAPE
python3 bench/py/e2e_model.py assets/tiny-qwen3 "$MODEL" "$SHAPE"
export MANTA_SGLANG_MODEL=$MODEL MANTA_SGLANG_ARGS=${SGLANG_ARGS:---attention-backend flashinfer} MANTA_SGLANG_LOG_DIR=$OUT/sglang_interop
status=0
MANTA_TEST_GPU=${MANTA_TEST_GPU:-0} RUST_LOG=${RUST_LOG:-info} timeout "${TEST_TIMEOUT:-1500}" \
  bin/tests/sglang_real --include-ignored --nocapture --test-threads=1 2>&1 | tee "$OUT/sglang_interop.log" || status=$?
grep -q 'test result: ok. 1 passed' "$OUT/sglang_interop.log" || status=1
echo "sglang interop: exit $status"
exit $status
