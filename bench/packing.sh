#!/usr/bin/env bash
# data.pack with JSONL against one example a row, in the same run: one epoch of a JSONL file of
# mixed lengths (an instruction-tuning shape: most examples short, some long) on a small Llama,
# both ways, same seed, model and precision. Prints each epoch's wall time, the target tokens it
# trained, the rows it computed, target tokens/s, the ratio, and each epoch's loss (the same
# examples and targets: they differ by the updates' grouping, not by what is scored).
#
#   bash bench/packing.sh [KEEL_BINARY]   (default build/keel; ~1 minute on 2 cores)
# Environment: EXAMPLES (default 1024), SEQ_LEN (512), BATCH (8), PRECISION (32-true), THREADS.
set -euo pipefail
cd "$(dirname "$0")/.."
keel=${1:-build/keel}
examples=${EXAMPLES:-1024}
seq_len=${SEQ_LEN:-512}
batch=${BATCH:-8}
precision=${PRECISION:-32-true}
threads=${THREADS:-$(nproc)}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

# Lengths in bytes (the byte tokenizer: a token a byte): 80% from 20 to 120, 20% from 120 to 500.
python3 - "$dir/data.jsonl" "$examples" <<'EOF'
import json, random, sys
random.seed(7)
words = "the of and to in is that for it as with was on be by at this are from or".split()
with open(sys.argv[1], "w") as f:
    for i in range(int(sys.argv[2])):
        n = random.randint(20, 120) if random.random() < 0.8 else random.randint(120, 500)
        text = ""
        while len(text) < n:
            text += random.choice(words) + " "
        cut = len(text[:n]) // 3
        f.write(json.dumps({"prompt": text[:cut], "completion": text[cut:n]}) + "\n")
EOF

run() {  # run NAME PACK
  local out="$dir/$1"
  local t0
  t0=$(date +%s.%N)
  "$keel" train --set run.out_dir="$out" --set run.threads="$threads" --set model.family=llama \
    --set model.n_layer=4 --set model.n_embd=256 --set model.n_head=8 --set model.n_kv_head=4 \
    --set data.task=jsonl --set data.path="$dir/data.jsonl" --set data.seq_len="$seq_len" \
    --set data.pack="$2" --set train.batch_size="$batch" --set train.epochs=1 \
    --set train.precision="$precision" --set log.tensorboard=false --set log.every=1000000 \
    >"$dir/$1.log" 2>&1 || { cat "$dir/$1.log"; exit 1; }
  local t1
  t1=$(date +%s.%N)
  python3 - "$1" "$dir/$1.log" "$t0" "$t1" "$dir/$1.rate" <<'EOF'
import re, sys
name, log, t0, t1, rate = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
text = open(log).read()
# "epoch 0 | loss 4.505 (token mean of 10 applied steps, 576 tokens) | step 10"
m = re.search(r"epoch 0 \| loss ([0-9.]+) \(token mean of (\d+) applied steps, (\d+) tokens\)", text)
loss, steps, tokens = float(m.group(1)), int(m.group(2)), int(m.group(3))
wall = t1 - t0
print(f"{name:9s} {steps:5d} steps {tokens:9d} target tokens {wall:8.2f} s "
      f"{tokens / wall:9.0f} target tok/s  epoch loss {loss:.4f}")
open(rate, "w").write(str(tokens / wall))
EOF
}

echo "bench/packing.sh: $examples examples, seq_len $seq_len, batch $batch, $precision, $threads threads"
run unpacked false
run packed true
python3 - "$dir/unpacked.rate" "$dir/packed.rate" <<'EOF'
import sys
u, p = (float(open(f).read()) for f in sys.argv[1:3])
print(f"packed / unpacked target tokens/s: {p / u:.2f}x")
EOF
grep -h "^data:" "$dir/packed.log" || true
