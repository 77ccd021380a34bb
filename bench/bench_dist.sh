#!/usr/bin/env bash
# Data-parallel scaling from 1 to 2 ranks (issue 8): tokens/s of `keel train` on one rank and on
# two ranks under mpirun, with the same global batch (1 rank: grad_accum 2; 2 ranks: grad_accum 1,
# rank r takes micro-batch r of each step), one OpenMP thread per rank, and the scaling efficiency
#   efficiency = tok/s(2 ranks) / (2 * tok/s(1 rank, 1 thread)).
# Also printed: 1 rank with 2 threads (the other way to spend the second core), the CPU seconds
# each run used (rusage of the whole process tree: less sensitive to other load on the machine
# than wall time; 2 ranks doing the work of 1 with no overhead would use the same), and rank 0's
# time inside the gradient all-reduce (what overlapping it with backward could save at most).
#
# usage: bench/bench_dist.sh [BUILD_DIR] [STEPS] [extra section.key=value overrides...]
#   e.g. GLIBC_TUNABLES=glibc.malloc.hugetlb=1 bench/bench_dist.sh build 20 model.n_layer=6
# tokens/s is the median over the steps after the first 3 (warm-up), from rank 0's metrics.jsonl;
# "target tok/s" counts the tokens the loss is taken over (the answers of the built-in task).
set -euo pipefail
BUILD=${1:-build}
STEPS=${2:-20}
shift $(( $# > 2 ? 2 : $# )) || true
KEEL="$BUILD/keel"
[ -x "$KEEL" ] || { echo "no $KEEL: build keel_cli first" >&2; exit 1; }
command -v mpirun >/dev/null || { echo "mpirun not found (Debian openmpi-bin)" >&2; exit 1; }
OUT=$(mktemp -d /tmp/keel-bench-dist.XXXXXX)
trap 'rm -rf "$OUT"' EXIT

/usr/bin/python3 - "$KEEL" "$OUT" "$STEPS" "$@" <<'PY'
import json, os, statistics, subprocess, sys
keel, out, steps, extra = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
# GPT-2 of 4 layers x 256 wide (3.4M parameters: 13 MB of f32 gradients per step, one bucket),
# 8 rows x 64 tokens per micro-batch.
common = ["model.n_layer=4", "model.n_embd=256", "model.n_head=4", "model.max_seq_len=64",
          "data.seq_len=64", "train.batch_size=8", "data.num_examples=4096",
          "data.eval_examples=0", "data.digits=8", f"train.max_steps={steps}",
          "log.tensorboard=false", "log.console=false", "sched.name=constant",
          "dist.check_every=0"] + extra

def run(name, ranks, threads, grad_accum):
    sets = common + [f"run.out_dir={out}/{name}", f"run.threads={threads}",
                     f"train.grad_accum={grad_accum}"]
    cmd = [keel, "train"] + [w for s in sets for w in ("--set", s)]
    if ranks > 1:
        cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(ranks)] + \
              (["-x", "GLIBC_TUNABLES"] if "GLIBC_TUNABLES" in os.environ else []) + cmd
    with open(f"{out}/{name}.log", "w") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        _, status, ru = os.wait4(p.pid, 0)
    text = open(f"{out}/{name}.log").read()
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"{name} failed:\n{text}")
    recs = [json.loads(l) for l in open(f"{out}/{name}/metrics.jsonl") if '"loss"' in l]
    tps = statistics.median([r["tokens_per_s"] for r in recs[3:]] or
                            [r["tokens_per_s"] for r in recs])
    dist = [l for l in text.splitlines() if l.startswith("dist:")]
    return tps, ru.ru_utime + ru.ru_stime, len(recs), dist

a, ca, n, _ = run("one_1t", 1, 1, 2)
b, cb, _, dist = run("two_1t", 2, 1, 1)
c, cc, _, _ = run("one_2t", 1, 2, 2)
print(f"{n} steps, same global batch (2 micro-batches of 8 x 64) in every run; "
      f"load average (1 min) after: {open('/proc/loadavg').read().split()[0]}")
print(f"1 rank  x 1 thread : {a:8.1f} target tok/s                                 CPU {ca:6.1f} s")
print(f"2 ranks x 1 thread : {b:8.1f} target tok/s  speedup {b/a:.2f}x  efficiency {b/(2*a)*100:3.0f}%"
      f"   CPU {cb:6.1f} s ({cb/ca:.2f}x)")
print(f"1 rank  x 2 threads: {c:8.1f} target tok/s  speedup {c/a:.2f}x                 CPU {cc:6.1f} s")
for l in dist:
    print(l)
PY
