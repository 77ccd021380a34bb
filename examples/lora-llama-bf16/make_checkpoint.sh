#!/bin/sh
# Writes examples/lora-llama-bf16/base/: a small, randomly initialized Llama-architecture model as a
# Hugging Face directory (config.json + model.safetensors, bf16 like published Llama weights),
# standing in for a downloaded checkpoint. Vocabulary 259 = keel's byte tokenizer.
#
#   sh examples/lora-llama-bf16/make_checkpoint.sh          # uses build/keel
#   KEEL=build-asan/keel sh examples/lora-llama-bf16/make_checkpoint.sh
#   OUT=/tmp/base sh examples/lora-llama-bf16/make_checkpoint.sh   # elsewhere (tests)
set -eu
KEEL=${KEEL:-build/keel}
HERE=$(dirname "$0")
OUT=${OUT:-$HERE/base}
"$KEEL" init-model --family llama --out "$OUT" \
  --n-layer 4 --n-embd 128 --n-head 8 --n-kv-head 4 --intermediate-size 352 \
  --vocab-size 259 --max-seq-len 256 --rope-theta 500000 --norm-eps 1e-5 \
  --untied --dtype bf16 --seed 2024
