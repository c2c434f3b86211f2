#!/usr/bin/env bash
# One device call for the hybrid families' bf16 agreement on CUDA, against the transformers
# release the model tests pin (pyproject's test extra), and what the installed one says:
#   (a) the installed transformers: the Mamba2 families' log-prob errors (engine float32
#       and bf16 against its float32) and the oracle's gated-norm check;
#   (b) the pinned transformers: the Mamba2 kernel and mixer tests on CUDA;
#   (c) the pinned transformers: the same log-prob errors;
#   (d) the pinned transformers: tests/models/test_hybrid_families_gpu.py, three pytest
#       processes of three families each, run beside (a)-(c).
# Logs under $OUT, the summary last.
#   OUT=/tmp/out bash benchmarks/hybrid_check.sh
# Needs the wheels in .devcache/whl (gguf, which vllmpy.tokenizer imports at start, and
# transformers at the pinned version: `pip download --no-deps --only-binary=:all: -d
# .devcache/whl transformers==VERSION`); carry .devcache/whl. Tracked files kept in
# .devcache/hybrid-head (HEAD's versions of files a concurrent edit leaves half-done) are
# copied over the tree first.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/hybrid_check}
mkdir -p "$OUT"
S=$OUT/summary.txt; : > "$S"
[ -d .devcache/hybrid-head ] && cp -r .devcache/hybrid-head/. . && echo "restored to HEAD: $(cd .devcache/hybrid-head && find . -type f | tr '\n' ' ')" >> "$S"
PIN=$(sed -n 's/.*"transformers==\([0-9.]*\)".*/\1/p' pyproject.toml)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .devcache/whl/gguf-*.whl >> "$S" 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/pinned \
    .devcache/whl/transformers-"$PIN"-*.whl >> "$S" 2>&1 || echo "no transformers $PIN wheel" >> "$S"
export PYTHONUNBUFFERED=1
INSTALLED=$PWD:/tmp/site PINNED=/tmp/pinned:$PWD:/tmp/site
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader >> "$S" 2>&1
for P in $INSTALLED $PINNED; do
  PYTHONPATH=$P python3 -c 'import torch,triton,transformers;print("torch",torch.__version__,"triton",triton.__version__,"transformers",transformers.__version__)' >> "$S" 2>&1
done
t0=$SECONDS
F=tests/models/test_hybrid_families_gpu.py::test_bf16_agrees_with_transformers
i=0
for g in "qwen3_next mamba2 deepseek-v2_lite" "qwen3_5 nemotron_h deepseek-v3" "qwen3_5_moe granite_moe_hybrid falcon_h1"; do
  ids=""; for v in $g; do ids="$ids $F[$v]"; done
  PYTHONPATH=$PINNED timeout -k 5 ${GROUP_S:-360} python3 -m pytest -q -s -p no:cacheprovider $ids > /tmp/hyb$i.log 2>&1 &
  i=$((i+1))
done
t=$SECONDS
PYTHONPATH=$INSTALLED timeout -k 5 120 python3 benchmarks/hybrid_fp32_check.py \
    --variants mamba2,granite_moe_hybrid > "$OUT/installed.log" 2>&1
echo "(a) installed transformers: fp32 check rc=$?" >> "$S"
PYTHONPATH=$INSTALLED timeout -k 5 60 python3 -m pytest -q -p no:cacheprovider \
    tests/models/test_mamba2_families.py -k oracle >> "$OUT/installed.log" 2>&1
echo "(a) installed transformers: gated-norm check rc=$? $((SECONDS-t))s" >> "$S"
t=$SECONDS
PYTHONPATH=$PINNED timeout -k 5 150 python3 -m pytest -q -p no:cacheprovider tests/ops/test_mamba_ssd.py \
    tests/ops/test_causal_conv1d.py tests/layers/test_mamba2_mixer.py > "$OUT/kernels.log" 2>&1
echo "(b) pinned: Mamba2 kernel and mixer tests on CUDA rc=$? $((SECONDS-t))s" >> "$S"
t=$SECONDS
PYTHONPATH=$PINNED timeout -k 5 180 python3 benchmarks/hybrid_fp32_check.py > "$OUT/pinned.log" 2>&1
echo "(c) pinned: fp32 check rc=$? $((SECONDS-t))s" >> "$S"
wait
for j in 0 1 2; do echo "=== group $j"; cat /tmp/hyb$j.log; done > "$OUT/hybrid_gpu.log"
echo "(d) pinned: test_hybrid_families_gpu $((SECONDS-t0))s:" >> "$S"
{
  grep -hE "^transformers|error against" "$OUT/installed.log" "$OUT/pinned.log" | cut -c1-300
  grep -hE "^E +AssertionError: transformers" "$OUT/installed.log" | cut -c1-300
  grep -hE "passed|failed" "$OUT/installed.log" "$OUT/kernels.log" | tail -3
  grep -hE "cuda bf16:|log-prob error|passed|failed|rror" /tmp/hyb?.log | grep -v "^E " | cut -c1-300
  grep -hE "^E " /tmp/hyb?.log | head -20 | cut -c1-300
} >> "$S"
cat "$S"
