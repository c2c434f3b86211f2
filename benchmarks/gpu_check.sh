#!/usr/bin/env bash
# One device call: the GPU tests of the model layer (kernels, CUDA graphs, every family in
# bf16 through the graphs) and then the speed rows, logs under $OUT, a short table last.
#   OUT=/tmp/out bash benchmarks/gpu_check.sh [ROWS] [PEERS]
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
ROWS=${1:-P2,P1,P3,G2,G3}
PEERS=${2:-qwen3-0.6b,gemma3-1b}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader > "$OUT/gpu.txt" 2>&1
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout ${TEST_S:-200} python3 -m pytest -q -s -p no:cacheprovider --timeout 240 \
      tests/ops/test_step_inputs.py \
      tests/worker/test_cuda_graphs.py tests/models/test_families_gpu.py \
      tests/models/test_tiny_models.py \
      -k "cuda or families or graphs or step_inputs" \
      > "$OUT/tests.log" 2>&1
  echo "tests rc=$? $(tail -1 "$OUT/tests.log")"
  grep -E "cuda bf16 graphs" "$OUT/tests.log" | head -40
fi
python3 benchmarks/gpu_table.py --out "$OUT/rows" --rows "$ROWS" --peer "$PEERS" \
    > "$OUT/table.txt" 2> "$OUT/rows.log"
cat "$OUT/table.txt"
