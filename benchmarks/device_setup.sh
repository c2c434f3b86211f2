# Sourced by the one-call device scripts (after `set -u`): the repository root as the
# working directory, $OUT made (its default is the first argument), the package on
# PYTHONPATH, unbuffered Python output, and the GPU's name and clocks in $OUT/gpu.txt.
#   source "$(dirname "$0")/device_setup.sh" /tmp/default_out
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-$1}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader > "$OUT/gpu.txt" 2>&1
