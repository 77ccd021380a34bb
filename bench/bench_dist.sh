#!/usr/bin/env bash
# Data-parallel scaling from 1 to 2 ranks (issue 8): tokens/s of `keel train` on one rank and on
# two ranks under mpirun, with the same global batch (1 rank: grad_accum 2; 2 ranks: grad_accum 1,
# rank r takes micro-batch r of each step), one OpenMP thread per rank, and the scaling efficiency
#   efficiency = tok/s(2 ranks) / (2 * tok/s(1 rank, 1 thread)).
# Also printed: 1 rank with 2 threads, the other way to spend the second core.
#
# usage: bench/bench_dist.sh [BUILD_DIR] [STEPS] [extra --set overrides...]
#   e.g. GLIBC_TUNABLES=glibc.malloc.hugetlb=1 bench/bench_dist.sh build 20 model.n_layer=6
# tokens/s is the median of the steps after the first 3 (warm-up), from rank 0's metrics.jsonl.
set -euo pipefail
BUILD=${1:-build}
STEPS=${2:-20}
shift $(( $# > 2 ? 2 : $# )) || true
KEEL="$BUILD/keel"
[ -x "$KEEL" ] || { echo "no $KEEL: build keel_cli first" >&2; exit 1; }
command -v mpirun >/dev/null || { echo "mpirun not found (Debian openmpi-bin)" >&2; exit 1; }
OUT=$(mktemp -d /tmp/keel-bench-dist.XXXXXX)
trap 'rm -rf "$OUT"' EXIT

# GPT-2 of 4 layers x 256 wide (3.4M parameters: 13 MB of f32 gradients per step, one bucket),
# 8 rows x 64 tokens per micro-batch.
COMMON=(model.n_layer=4 model.n_embd=256 model.n_head=4 model.max_seq_len=64 data.seq_len=64
        train.batch_size=8 data.num_examples=4096 data.eval_examples=0 data.digits=8
        train.max_steps="$STEPS" log.tensorboard=false log.console=false sched.name=constant
        dist.check_every=0 "$@")
sets() { for s in "$@"; do printf -- '--set\n%s\n' "$s"; done; }

run() {  # name ranks threads grad_accum
  local name=$1 np=$2 th=$3 ga=$4
  mapfile -t args < <(sets "${COMMON[@]}" run.out_dir="$OUT/$name" run.threads="$th" \
                      train.grad_accum="$ga")
  if [ "$np" = 1 ]; then
    "$KEEL" train "${args[@]}" >"$OUT/$name.log" 2>&1
  else
    mpirun --allow-run-as-root --oversubscribe -np "$np" ${GLIBC_TUNABLES:+-x GLIBC_TUNABLES} \
      "$KEEL" train "${args[@]}" >"$OUT/$name.log" 2>&1
  fi || { cat "$OUT/$name.log" >&2; exit 1; }
}

run one_1t 1 1 2
run two_1t 2 1 1
run one_2t 1 2 2

/usr/bin/python3 - "$OUT" <<'PY'
import json, statistics, sys
out = sys.argv[1]
def tps(name):
    recs = [json.loads(l) for l in open(f"{out}/{name}/metrics.jsonl") if '"loss"' in l]
    v = [r["tokens_per_s"] for r in recs[3:]] or [r["tokens_per_s"] for r in recs]
    return statistics.median(v), len(recs)
a, n = tps("one_1t"); b, _ = tps("two_1t"); c, _ = tps("one_2t")
print(f"steps {n}, same global batch (2 micro-batches of 8 x 64) in every run")
print(f"1 rank  x 1 thread : {a:10.1f} target tok/s")
print(f"2 ranks x 1 thread : {b:10.1f} target tok/s   speedup {b/a:.2f}x   scaling efficiency {b/(2*a)*100:.0f}%")
print(f"1 rank  x 2 threads: {c:10.1f} target tok/s   speedup {c/a:.2f}x   (threads instead of ranks)")
PY
grep -h '^dist:' "$OUT/two_1t.log" || true
