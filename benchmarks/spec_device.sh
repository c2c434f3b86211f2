#!/usr/bin/env bash
# One device call for speculative decoding: the engine tests on the GPU (every method,
# float32 through the CUDA graphs), then rows S3 and S4; logs under $OUT, the table last.
#   OUT=/tmp/out bash benchmarks/spec_device.sh
set -u
source "$(dirname "$0")/device_setup.sh" /tmp/spec_device
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  [ -d .devcache/tok ] && export VLLMPY_TEST_TOKENIZER_DIR=$PWD/.devcache/tok
  timeout ${TEST_S:-240} python3 -m pytest -q -p no:cacheprovider --timeout 200 \
      tests/spec_decode/test_spec_engine.py -k cuda > "$OUT/tests.log" 2>&1
  echo "tests rc=$? $(grep -E 'passed|failed|error' "$OUT/tests.log" | tail -1)"
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20
fi
timeout ${ROWS_S:-300} python3 benchmarks/spec_gpu.py --out "$OUT" > "$OUT/rows.log" 2>&1
echo "rows rc=$?"
grep -E "CUDA graphs|S3:|S4 " "$OUT/rows.log" | head -20
sed -n '/^| row/,$p' "$OUT/rows.log"
