#!/usr/bin/env bash
# One device call for the hybrid and latent-attention MoE rows: H1 (Qwen3-Next-shaped,
# 12 layers, batch 1), H1x64 (64 requests), H2 (DeepSeek-V2-Lite, batch 1), each beside
# transformers on the same config; logs and JSON under $OUT, the table last.
#   OUT=/tmp/out bash benchmarks/hybrid_device.sh [ROWS] [PEERS] [more hybrid_gpu.py flags]
# e.g. one call for H1,H1x64 with peer H1 and another for H2 with peer H2 if one call of
# all three does not fit; "--tiny --device cpu" runs the smoke test.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/hybrid_device}
ROWS=${1:-H1,H1x64,H2}
PEERS=${2-H1,H2}
shift $(( $# < 2 ? $# : 2 ))
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used,memory.total --format=csv,noheader \
    > "$OUT/gpu.txt" 2>&1
timeout ${ROWS_S:-570} python3 benchmarks/hybrid_gpu.py --out "$OUT" --rows "$ROWS" \
    --peer "$PEERS" "$@" > "$OUT/rows.log" 2>&1
echo "rows rc=$?"
grep -E "^(device|copy bandwidth|H[12]: .* layers:)" "$OUT/rows.log" | cut -c1-300
grep -E "Error|error:" "$OUT/rows.log" | grep -vE "^\s*[{|]" | head -5
sed -n '/^| row/,$p' "$OUT/rows.log" | tee "$OUT/table.txt"
