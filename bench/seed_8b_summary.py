#!/usr/bin/python3
"""The figures of one bench/seed_8b.sh run: peak RSS (the child's ru_maxrss) beside `keel memory`'s
estimate and the goal, seconds per step, tokens/s and MFU against keel's bf16 matmul peak (probed
by bench/matmul_peak before and after the run; the higher one). FLOPs per token are
compare_pytorch's (bench/compare_pytorch/compare.py flops_per_token: an adapter step's model FLOPs).
Run by seed_8b.sh; its arguments are that script's.

    seed_8b_summary.py run TIME.json -- CMD ...   runs CMD (output inherited) and writes its exit
                                                  code, wall seconds and peak RSS (bytes) to TIME.json
"""
import argparse
import json
import os
import statistics
import sys
import time


GOAL_GB = 22.0  # issue 25: the 8B run's peak RSS on a 24 GB machine


def run_measured(out, cmd):
    """Runs cmd; its peak RSS is the ru_maxrss wait4 reports for it. Linux carries the spawning
    process's high-water mark through the child's exec (ru_maxrss is the max of both), so this mode
    imports nothing large: with compare (numpy) imported the tiny shape's run read 35 MB, without
    it 26.6 MB, against 25.8 MB from /usr/bin/time -v."""
    import shutil
    t0 = time.monotonic()
    pid = os.posix_spawn(shutil.which(cmd[0]) or cmd[0], cmd, os.environ)
    _, status, usage = os.wait4(pid, 0)
    wall = time.monotonic() - t0
    rc = os.waitstatus_to_exitcode(status)
    rss = usage.ru_maxrss * 1024  # KiB on Linux
    with open(out, "w") as f:
        json.dump({"rc": rc, "wall_s": wall, "peak_rss": rss}, f)
    return rc


def num(x):
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def size(b):
    return f"{b / 1e9:.2f} GB" if b >= 1e9 else f"{b / 1e6:.0f} MB"


def main():
    if len(sys.argv) > 3 and sys.argv[1] == "run" and sys.argv[3] == "--":
        return run_measured(sys.argv[2], sys.argv[4:])
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "compare_pytorch"))
    import compare  # numpy with it: not in the process that starts keel (run_measured)
    p = argparse.ArgumentParser(description=__doc__)
    for k in ("shape", "kind", "ckpt", "device", "metrics", "time", "estimate", "estimate_from"):
        p.add_argument("--" + k.replace("_", "-"), required=True)
    for k in ("batch", "accum", "seq", "steps"):
        p.add_argument("--" + k, type=int, required=True)
    p.add_argument("--peaks", type=float, nargs=2, required=True)
    a = p.parse_args()

    adapter = dict(compare.SEED_LORA, kind=a.kind)
    c = compare.from_shape(a.shape, a.batch, a.seq, adapter=adapter)
    print(f"\nseed {a.shape} {a.kind}: {a.steps} steps of {a.batch} x {a.accum} x {a.seq} tokens, "
          f"bf16-mixed, bf16 base, r={adapter['r']} on {','.join(adapter['targets'])}, "
          f"activation checkpointing {a.ckpt}, {a.device}")
    measured = json.load(open(a.time))
    rss, wall, a.rc = measured["peak_rss"], measured["wall_s"], measured["rc"]
    est = json.load(open(a.estimate))
    total = est.get("total", 0)
    how = ("keel memory --config" if a.estimate_from == "config" else
           "keel memory from sizes only (this keel memory takes no config: no adapter, full "
           "fine-tune state)")
    ratio = f", measured / estimate {rss / total:.2f}" if total else ""
    print(f"  peak RSS {size(rss)} (ru_maxrss of the whole run: loading, steps, final "
          f"save); estimate {size(total)} ({how}){ratio}")
    if a.shape == "8b":
        print(f"  goal: peak RSS <= {GOAL_GB:g} GB: {'met' if rss <= GOAL_GB * 1e9 else 'NOT met'}")
    print(f"  wall {wall:.1f} s for the whole `keel train` (exit {a.rc})")

    steps = []
    if os.path.exists(a.metrics):
        for line in open(a.metrics):
            r = json.loads(line)
            if "loss" in r and isinstance(r.get("tokens_per_s"), (int, float)) and r["tokens_per_s"]:
                steps.append(r)
    if not steps:
        print("  no step finished (see train.log)")
        return 1 if a.rc else 0
    # keel's tokens_per_s counts target tokens: a packed row of SEQ tokens has SEQ - 1.
    targets = a.batch * a.accum * (a.seq - 1)
    tokens = a.batch * a.accum * a.seq
    secs = [targets / r["tokens_per_s"] for r in steps]
    for r, s in zip(steps, secs):
        print(f"  step {r['step']}: {s:.3g} s, {num(tokens / s)} tokens/s, loss {r['loss']:.4f}, "
              f"grad_norm {r['grad_norm']:.3g}, lr {r['learning_rate']:.3g}")
    # The first step pays one-time costs (oneDNN primitive creation, first touch of every buffer).
    timed = secs[1:] or secs
    med = statistics.median(timed)
    peak = max(a.peaks)
    line = (f"  seconds per step {med:.3g} (median of steps {2 if len(secs) > 1 else 1}.."
            f"{len(secs)}), {num(tokens / med)} tokens/s")
    if a.device == "cpu":
        mfu = tokens / med * compare.flops_per_token(c, a.seq) / (peak * 1e9)
        line += (f", MFU {100 * mfu:.1f}% of the bf16 matmul peak ({peak:.0f} GFLOP/s, 1024^3 in "
                 f"keel's kernels; probes {min(a.peaks):.0f}..{peak:.0f})")
    else:
        line += " (MFU: keel's probe is a CPU one; GPU figures are in docs/cuda.md)"
    print(line)
    return 1 if a.rc else 0


if __name__ == "__main__":
    sys.exit(main())
