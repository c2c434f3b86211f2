#!/usr/bin/env bash
# One GPU session for the quantized-weights rows: builds llama.cpp's CUDA llama-bench in
# the background (from a llama.cpp source tree, default vendor/llama.cpp), runs the int4
# kernel tests and the W4A16 GPU tests, sweeps the one-row int4 GEMV's launch
# configurations, times the Q4 row, then Q1 beside llama-bench on the same GGUF when the
# build has finished. Logs and JSON go to $OUT (default ./quant-device-out).
#
#   OUT=DIR bash benchmarks/quant_device.sh [LLAMA_CPP_DIR] [SECONDS]
#
# SECONDS (default 580) bounds the whole run; each step gets what is left of it.
set -u
OUT=${OUT:-quant-device-out}
SRC=${1:-vendor/llama.cpp}
BUDGET=${2:-580}
START=$(date +%s)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
step() {  # step NAME SECONDS CMD...: run CMD with at most SECONDS (or what is left)
  local name=$1 limit=$2; shift 2
  local have; have=$(left)
  (( have < limit )) && limit=$have
  if (( limit < 10 )); then echo "== $name: skipped, out of time"; return 1; fi
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "   rc=$rc after $(( $(date +%s) - START ))s"; tail -n 4 "$OUT/$name.log"
  return $rc
}

if [[ -d $SRC ]]; then
  ( cmake -S "$SRC" -B /tmp/llama-build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
      -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release \
    && nice cmake --build /tmp/llama-build --target llama-bench -j 12 ) \
    > "$OUT/llama-build.log" 2>&1 &
  BUILD=$!
fi

step int4-tests 150 python -m pytest -q -p no:cacheprovider tests/ops/test_int4_kernels.py \
  tests/layers/test_quantized_gpu.py -k "not fp8 and not kept_blocks"
step int4-sweep 150 python benchmarks/investigations/quant_kernels.py --sweep-int4 --only-sweeps
step q4 160 python benchmarks/quant_rows.py --out "$OUT/rows" --rows Q4
if [[ -n ${BUILD:-} ]]; then
  step q1-gguf 60 python benchmarks/quant_rows.py --write-gguf /tmp/q1.gguf
  while kill -0 "$BUILD" 2>/dev/null && (( $(left) > 100 )); do sleep 5; done
  tail -n 3 "$OUT/llama-build.log"
  BIN=/tmp/llama-build/bin/llama-bench
  if [[ -x $BIN ]]; then
    step q1 200 python benchmarks/quant_rows.py --out "$OUT/q1" --rows Q1 --gguf /tmp/q1.gguf \
      --llama-bench "$BIN"
  else
    step q1 200 python benchmarks/quant_rows.py --out "$OUT/q1" --rows Q1 --gguf /tmp/q1.gguf
  fi
fi
echo "== sweep"; grep -A12 "one-row int4" "$OUT/int4-sweep.log"
echo "== rows"; cat "$OUT"/rows/quant_rows.json "$OUT"/q1/quant_rows.json 2>/dev/null
