#!/usr/bin/env bash
# One device call for the pooling path: real MiniLM weights (rounded to bf16, carried in
# .devcache/minilm-bf16) in bf16 on the GPU against sentence-transformers in fp32 on the
# same files, then the BERT-base-shaped speed row; logs under $OUT, the tables last.
#   OUT=/tmp/out [PROFILE=1] bash benchmarks/pooling_device.sh
# PROFILE=1 first profiles vllmpy's BERT-base run (cProfile and torch.profiler tables).
# Needs the package's own dependencies importable (gguf among them: vllmpy.tokenizer
# imports it at start), sentence-transformers, and the MiniLM files in .devcache/minilm-bf16
# (the checkpoint's tensors rounded to bf16, its tokenizer and module files) and
# .devcache/minilm-tok (the tokenizer and module files alone, for the BERT-base row).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/pooling_device}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if [ -d .devcache/minilm-bf16 ]; then
  timeout 240 python3 benchmarks/embed_bench.py --model .devcache/minilm-bf16 --device cuda \
      --dtype bfloat16 --st-dtypes float32 --num 2000 --out "$OUT/minilm.json" \
      > "$OUT/minilm.log" 2>&1
  echo "minilm rc=$?"; sed -n '/^| engine/,$p' "$OUT/minilm.log"
fi
if [ -n "${PROFILE:-}" ]; then  # vllmpy alone on 3,000 sentences, profiled (host and device)
  timeout 150 python3 benchmarks/embed_bench.py --model bert-base --skip-st \
      --tokenizer-dir .devcache/minilm-tok --device cuda --dtype bfloat16 --num 3000 \
      --cprofile "$OUT/bert_base_cprofile.txt" --profile "$OUT/bert_base_profile.txt" \
      > /tmp/bert_base_profiled.log 2>&1
  echo "bert-base profiled rc=$?"; grep "vllmpy:" /tmp/bert_base_profiled.log
fi
timeout 300 python3 benchmarks/embed_bench.py --model bert-base \
    --tokenizer-dir .devcache/minilm-tok --device cuda --dtype bfloat16 \
    --st-dtypes float32,bfloat16 --num 10000 \
    > "$OUT/bert_base.log" 2>&1
echo "bert-base rc=$?"; sed -n '/^| engine/,$p' "$OUT/bert_base.log"
