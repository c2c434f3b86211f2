#!/usr/bin/env bash
# One device call for the MoE layer: its GPU tests, the decode kernel sweep, then speed
# rows (default E1,E3) and optionally the transformers peer, logs under $OUT.
#   OUT=/tmp/out bash benchmarks/moe_device.sh [ROWS] [PEERS] [TEST_K]
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/moe_device}
ROWS=${1:-E1,E3}
PEERS=${2:-}
TEST_K=${3:-Moe or Mixtral or Olmoe or Granite or Phimoe or GptOss}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout ${TEST_S:-240} python3 -m pytest -q -p no:cacheprovider \
      tests/ops/test_fused_moe.py tests/ops/test_moe_decode.py tests/layers/test_moe_layouts.py \
      tests/quant/test_fp8_moe.py > "$OUT/kernel_tests.log" 2>&1
  echo "kernel tests rc=$? $(tail -1 "$OUT/kernel_tests.log")"
  grep -E "^FAILED|Error" "$OUT/kernel_tests.log" | head -10
  timeout ${TEST_S:-240} python3 -m pytest -q -s -p no:cacheprovider \
      tests/models/test_families_gpu.py -k "$TEST_K" > "$OUT/families.log" 2>&1
  echo "families rc=$? $(tail -1 "$OUT/families.log")"
  grep -E "cuda bf16 graphs|^FAILED" "$OUT/families.log" | head -20
fi
if [ "${SKIP_SWEEP:-0}" != 1 ]; then
  timeout 150 python3 benchmarks/investigations/moe_kernels.py > "$OUT/sweep.txt" 2>&1
  echo "sweep rc=$?"; head -8 "$OUT/sweep.txt"; tail -2 "$OUT/sweep.txt"
fi
python3 benchmarks/gpu_table.py --out "$OUT/rows" --rows "$ROWS" --peer "$PEERS" \
    > "$OUT/table.txt" 2> "$OUT/rows.log"
cat "$OUT/table.txt"
