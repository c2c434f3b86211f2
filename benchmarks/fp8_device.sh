#!/usr/bin/env bash
# One device call for the FP8 decode path: the streaming kernel's fp8 tests and the FP8
# checkpoint agreement tests on the GPU, the one-row kernel sweep (bf16 and fp8 weights
# through the streaming kernel, beside the fp8 block GEMV), then rows P1 (bf16) and Q2
# (FP8 block-128) in the same run; logs under $OUT, the table last.
#   OUT=/tmp/out bash benchmarks/fp8_device.sh
# A gguf wheel in .devcache/whl is installed first (the GPU tests' module imports gguf).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/fp8_device}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader > "$OUT/gpu.txt" 2>&1
ls .devcache/whl/gguf-*.whl > /dev/null 2>&1 && \
  python3 -m pip install -q --no-deps .devcache/whl/gguf-*.whl > "$OUT/pip.log" 2>&1
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout ${TEST_S:-200} python3 -m pytest -q -p no:cacheprovider -s \
      tests/ops/test_skinny_gemm.py -k fp8 \
      "tests/layers/test_quantized_gpu.py::test_quantized_checkpoint_on_cuda_follows_its_cpu_dequantization" \
      -k "fp8" > "$OUT/tests.log" 2>&1
  echo "tests rc=$? $(grep -E 'passed|failed|error' "$OUT/tests.log" | tail -1)"
  grep -E "^(FAILED|ERROR)|cuda bf16 vs cpu" "$OUT/tests.log" | head -20
fi
timeout ${SWEEP_S:-150} python3 benchmarks/investigations/quant_kernels.py --sweep-stream \
    --only-sweeps > "$OUT/sweep.log" 2>&1
echo "sweep rc=$?"
timeout ${ROWS_S:-260} python3 benchmarks/quant_rows.py --out "$OUT/rows" --rows ${ROWS:-P1,Q2} \
    > "$OUT/rows.log" 2>&1
echo "rows rc=$?"
tail -n 3 "$OUT"/rows/*.log
cat "$OUT/sweep.log"
cat "$OUT/rows.log"
