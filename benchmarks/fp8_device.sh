#!/usr/bin/env bash
# One device call for the FP8 paths: the fp8 tests of the streaming kernel, the fp8 kernel
# tests (the cuBLAS block-scaled GEMM among them), the MoE router kernel's tests and the
# FP8 checkpoint agreement tests on the GPU; the rows in $ROWS
# (default P1,Q2: bf16 and FP8 block-128 batch-1 decode in the same run; P4,Q3 for the
# batched pair; E1,E3 run through gpu_table.py when named in $MOE_ROWS); then the one-row
# kernel sweep (bf16 and fp8 weights through the streaming kernel, beside the fp8 block
# GEMV). Logs under $OUT, the table last. SKIP_TESTS=1 and SKIP_SWEEP=1 leave those parts out.
#   OUT=/tmp/out bash benchmarks/fp8_device.sh
# A gguf wheel in .devcache/whl is installed first (the GPU tests' module imports gguf).
set -u
source "$(dirname "$0")/device_setup.sh" /tmp/fp8_device
cat "$OUT/gpu.txt"
ls .devcache/whl/gguf-*.whl > /dev/null 2>&1 && \
  python3 -m pip install -q --no-deps .devcache/whl/gguf-*.whl > "$OUT/pip.log" 2>&1
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout ${TEST_S:-200} python3 -m pytest -q -p no:cacheprovider -s \
      tests/ops/test_skinny_gemm.py tests/ops/test_fp8_kernels.py tests/ops/test_moe_router.py \
      "tests/layers/test_quantized_gpu.py::test_quantized_checkpoint_on_cuda_follows_its_cpu_dequantization" \
      -k "fp8 or router" > "$OUT/tests.log" 2>&1
  echo "tests rc=$? $(grep -E 'passed|failed|error' "$OUT/tests.log" | tail -1)"
  grep -E "^(FAILED|ERROR)|cuda bf16 vs cpu|cuBLAS block-scaled" "$OUT/tests.log" | sort -u | head -20
fi
timeout ${ROWS_S:-300} python3 benchmarks/quant_rows.py --out "$OUT/rows" --rows ${ROWS:-P1,Q2} \
    > "$OUT/rows.log" 2>&1
echo "rows rc=$?"
if [ -n "${MOE_ROWS:-}" ]; then
  timeout ${MOE_S:-300} python3 benchmarks/gpu_table.py --out "$OUT/moe" --rows "$MOE_ROWS" \
      --peer "" > "$OUT/moe.log" 2>&1
  echo "moe rc=$?"
  tail -n 15 "$OUT/moe.log"
fi
if [ "${SKIP_SWEEP:-0}" != 1 ]; then
  timeout ${SWEEP_S:-150} python3 benchmarks/investigations/quant_kernels.py --sweep-stream \
      --only-sweeps > "$OUT/sweep.log" 2>&1
  echo "sweep rc=$?"
fi
for f in "$OUT"/rows/*.log; do echo "== $f"; grep -E "quantized linear|fp8|Error|error" "$f" | head -5; tail -n 2 "$f"; done
cat "$OUT/sweep.log" 2>/dev/null | tail -20
cat "$OUT/rows.log"
