#!/usr/bin/env bash
# The seed's job as a bench (issue 25 item 4): a Llama-3.1-8B LoRA and DoRA fine-tune in bf16 on
# this machine, through `keel train`, with its peak RSS beside `keel memory`'s estimate.
#
#   bench/seed_8b.sh [BUILD_DIR = build]        # needs BUILD_DIR/keel and BUILD_DIR/bench/matmul_peak
#
# Environment (defaults = the seed's recipe):
#   MODEL=8b|1b|tiny   Llama-3.1-8B, Llama-3.2-1B (quick enough to run often) or a seconds-long shape
#   KIND="lora dora"   the adapters to run, in order
#   STEPS=2 BATCH=2 ACCUM=8 SEQ=512   optimizer steps, micro-batch, accumulation, sequence length
#   CKPT=blocks        train.activation_checkpointing (none to run without)
#   THREADS=0          run.threads (0 = all cores)     DEVICE=cpu   run.device (cuda: issue 25 item 6)
#   DIR=/tmp/keel-seed checkpoint, data and runs       KEEP=0       1 keeps each run's checkpoints/
#
# 1. A random checkpoint in HF's sharded layout (bench/write_random_hf.py: the real config.json,
#    bf16, 5 GB shards, streamed to disk), skipped when DIR already holds it.
# 2. A text file of STEPS x BATCH x ACCUM packed rows of SEQ bytes (keel's byte tokenizer: its 259
#    ids fit the 128,256-row vocabulary, and its own <pad> needs no new row).
# 3. Per adapter: the recipe's config (LoRA/DoRA r=32, alpha 64, dropout 0.05 on q, k, v, up, down;
#    AdamW lr 3e-5 (0.9, 0.999, 1e-8), weight decay 0 (HF Trainer's default), warmup 6%, cosine,
#    clip 1.0; bf16-mixed, model.base_dtype = bf16), `keel memory`'s estimate of it, then
#    `keel train` with its peak RSS measured (ru_maxrss), with keel's bf16 matmul peak probed before and after.
#    Printed: peak RSS against the estimate and the goal (<= 22 GB), seconds per step, tokens/s and
#    MFU (bench/seed_8b_summary.py).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${1:-$ROOT/build}
MODEL=${MODEL:-8b}
KIND=${KIND:-lora dora}
STEPS=${STEPS:-2}
BATCH=${BATCH:-2}
ACCUM=${ACCUM:-8}
SEQ=${SEQ:-512}
CKPT=${CKPT:-blocks}
THREADS=${THREADS:-0}
DEVICE=${DEVICE:-cpu}
DIR=${DIR:-/tmp/keel-seed}
KEEP=${KEEP:-0}
PY=/usr/bin/python3  # Debian's, with numpy (python3-numpy)

KEEL=$BUILD/keel
PEAK=$BUILD/bench/matmul_peak
for b in "$KEEL" "$PEAK"; do
  [ -x "$b" ] || { echo "seed_8b: $b is missing: ninja -C $BUILD keel_cli matmul_peak" >&2; exit 2; }
done
# write_random_hf.py needs numpy, which scripts/install-deps.sh adds only with KEEL_WITH_TORCH=1:
# say so here rather than in a Python traceback.
"$PY" -c 'import numpy' 2>/dev/null || {
  echo "seed_8b: $PY has no numpy (bench/write_random_hf.py needs it): apt-get install" \
    "python3-numpy, or KEEL_WITH_TORCH=1 bash scripts/install-deps.sh" >&2
  exit 2
}
case $MODEL in 8b | 1b | tiny) ;; *) echo "seed_8b: MODEL=$MODEL: use 8b, 1b or tiny" >&2; exit 2 ;; esac
for k in $KIND; do
  case $k in lora | dora) ;; *) echo "seed_8b: KIND=$k: use lora and/or dora" >&2; exit 2 ;; esac
done
# The checkpointing key is issue 25 item 2; docs/config.md lists exactly the keys keel reads (a
# test holds them together), so a tree without it stops here instead of inside keel's parser.
# shellcheck disable=SC2016  # the backticks are docs/config.md's, not a command
if [ "$CKPT" != none ] && ! grep -q '`activation_checkpointing`' "$ROOT/docs/config.md"; then
  echo "seed_8b: this keel has no train.activation_checkpointing (issue 25 item 2) yet;" \
    "CKPT=none runs without it (an 8B run then needs far more than 24 GB)" >&2
  exit 2
fi

mkdir -p "$DIR"
CKPT_DIR=$DIR/llama-$MODEL
$PY "$ROOT/bench/write_random_hf.py" --shape "$MODEL" --out "$CKPT_DIR"

ROWS=$((STEPS * BATCH * ACCUM))
DATA=$DIR/data-${ROWS}x$SEQ.txt
if [ ! -s "$DATA" ]; then
  # Packed rows overlap by one token: ROWS rows of SEQ tokens need ROWS * (SEQ - 1) + 1 bytes.
  $PY - "$DATA" $((ROWS * (SEQ - 1) + 1)) <<'EOF'
import random, sys
path, n = sys.argv[1], int(sys.argv[2])
rng = random.Random(1234)
words = "the of and to in is was for on that with as by at from it an be this which or are".split()
words += [''.join(rng.choice("etaoinshrdlucmfwypvbgk") for _ in range(rng.randint(3, 9)))
          for _ in range(500)]
out, size = [], 0
while size < n:
    line = " ".join(rng.choice(words) for _ in range(rng.randint(8, 20))).capitalize() + ".\n"
    out.append(line)
    size += len(line)
open(path, "w").write("".join(out)[:n])
EOF
fi

probe() { "$PEAK" bf16 0.3 | $PY -c 'import json, sys; print(json.load(sys.stdin)["gflops"])'; }

for kind in $KIND; do
  RUN=$DIR/run-$MODEL-$kind
  mkdir -p "$RUN"
  CFG=$RUN/config.toml
  cat >"$CFG" <<EOF
[run]
out_dir = "$RUN/out"
overwrite = true
threads = $THREADS
device = "$DEVICE"

[model]
path = "$CKPT_DIR"
base_dtype = "bf16"

[model.adapter]
kind = "$kind"
r = 32
alpha = 64.0
dropout = 0.05
target_modules = ["q_proj", "k_proj", "v_proj", "up_proj", "down_proj"]

[data]
task = "text"
path = "$DATA"
tokenizer = "byte"
seq_len = $SEQ
pack = true

[train]
precision = "bf16-mixed"
batch_size = $BATCH
grad_accum = $ACCUM
max_steps = $STEPS
max_grad_norm = 1.0
EOF
  [ "$CKPT" != none ] && echo "activation_checkpointing = \"$CKPT\"" >>"$CFG"
  cat >>"$CFG" <<EOF

[optim]
name = "adamw"
lr = 3e-5
beta1 = 0.9
beta2 = 0.999
eps = 1e-8
weight_decay = 0.0

[sched]
name = "cosine"
warmup_ratio = 0.06

[log]
every = 1
tensorboard = false
EOF

  # keel memory's estimate of this config (issue 25 item 3 teaches it configs and adapters); a
  # keel memory without --config gets the sizes only, and the summary says so.
  if "$KEEL" memory --help | grep -- --config >/dev/null; then  # (no -q: no SIGPIPE under pipefail)
    "$KEEL" memory --config "$CFG" --json >"$RUN/estimate.json"
    ESTIMATE_FROM=config
  else
    ESTIMATE_FROM=sizes
    $PY - "$CKPT_DIR/config.json" "$BATCH" "$SEQ" >"$RUN/estimate.args" <<'EOF'
import json, sys
c, B, T = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3]
print(" ".join(["--family", "llama", "--precision", "bf16-mixed", "--batch", B, "--seq", T,
                "--layers", str(c["num_hidden_layers"]), "--hidden", str(c["hidden_size"]),
                "--heads", str(c["num_attention_heads"]), "--kv-heads",
                str(c["num_key_value_heads"]), "--ffn", str(c["intermediate_size"]), "--vocab",
                str(c["vocab_size"]), "--tie-embeddings",
                "true" if c["tie_word_embeddings"] else "false"]))
EOF
    # shellcheck disable=SC2046
    "$KEEL" memory $(cat "$RUN/estimate.args") --json >"$RUN/estimate.json"
  fi

  PEAK_BEFORE=$(probe)
  echo "seed_8b: keel train $CFG (log: $RUN/train.log)" >&2
  set +e
  $PY "$ROOT/bench/seed_8b_summary.py" run "$RUN/time.json" -- "$KEEL" train "$CFG" \
    >"$RUN/train.log" 2>&1
  RC=$?
  set -e
  PEAK_AFTER=$(probe)
  if [ $RC -ne 0 ]; then
    echo "seed_8b: keel train exited $RC; the end of $RUN/train.log:" >&2
    tail -n 20 "$RUN/train.log" >&2
  fi
  $PY "$ROOT/bench/seed_8b_summary.py" --shape "$MODEL" --kind "$kind" --batch "$BATCH" \
    --accum "$ACCUM" --seq "$SEQ" --steps "$STEPS" --ckpt "$CKPT" --device "$DEVICE" \
    --metrics "$RUN/out/metrics.jsonl" --time "$RUN/time.json" --estimate "$RUN/estimate.json" \
    --estimate-from "$ESTIMATE_FROM" --peaks "$PEAK_BEFORE" "$PEAK_AFTER"
  # The final checkpoint (the adapter, its optimizer state and a reference to the base): dropped
  # unless KEEP=1.
  [ "$KEEP" = 1 ] || rm -rf "$RUN/out/checkpoints"
  [ $RC -eq 0 ] || exit $RC
done
