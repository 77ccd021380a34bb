#!/usr/bin/env python3
"""Where a training step's oneDNN time goes, per primitive and shape, in the steady state.

oneDNN times every primitive it runs when ONEDNN_VERBOSE=1. Run a few steps of compare_keel
(or `keel train`) that way and pipe the output here: each distinct (primitive, layouts, shape)
gets its time per step and the median time of one call, over the steps after the warm-up (the
first step creates the primitives and touches every buffer for the first time).

  M=/tmp/keel-compare/gpt2-124m-b4t64
  ONEDNN_VERBOSE=1 OMP_WAIT_POLICY=active build/bench/compare_keel --model $M/model \\
      --ids $M/ids-8x4x65.bin --batch 4 --seq 64 --steps 8 --precision 32-true --threads 2 \\
      | python3 bench/onednn_profile.py --steps 8 --warmup 2

Compare a call's median here with the same shape on warm data (bench_kernels) to see what the
step's cold caches cost; this is how mlp.c_proj's f32 dX was found running at half rate.
"""
import argparse
import collections
import statistics
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, required=True, help="steps the run took")
    ap.add_argument("--warmup", type=int, default=2, help="leading steps left out")
    ap.add_argument("--top", type=int, default=20, help="rows printed")
    args = ap.parse_args()
    if not 0 <= args.warmup < args.steps:
        sys.exit("onednn_profile: --warmup must be at least 0 and less than --steps")

    calls = collections.defaultdict(list)  # (primitive, layouts, shape) -> ms of each call, in order
    for line in sys.stdin:
        f = line.rstrip("\n").split(",")
        if len(f) < 6 or f[1] != "exec" or not f[0].endswith("_verbose"):
            continue
        layouts = f[6].replace("::blocked", "").replace(":f0", "")
        calls[(f[3], layouts, f[-2])].append(float(f[-1]))
    if not calls:
        sys.exit("onednn_profile: no 'exec' lines on stdin; was ONEDNN_VERBOSE=1 set?")

    kept = args.steps - args.warmup
    rows, total = [], 0.0
    for key, ms in calls.items():
        per_step = len(ms) // args.steps
        if per_step == 0:  # ran in fewer steps than all (the MFU peak's product, say)
            continue
        steady = ms[-kept * per_step:]
        total += sum(steady) / kept
        rows.append((sum(steady) / kept, per_step, statistics.median(steady), key))
    rows.sort(reverse=True)
    print(f"{'ms/step':>8} {'calls':>5} {'median':>8}  primitive, layouts, shape")
    for ms_step, per_step, med, (prim, layouts, shape) in rows[: args.top]:
        print(f"{ms_step:8.1f} {per_step:5d} {med:8.2f}  {prim} {layouts} {shape}")
    print(f"{total:8.1f} ms per step in oneDNN (steps {args.warmup + 1}..{args.steps})")


if __name__ == "__main__":
    main()
