#!/usr/bin/env bash
# Device check of the CUDA backend (issue 7), in one call of at most 8 minutes on a fresh GPU
# machine: configure and build (Release, sm_90, only what is needed), run the GPU tests, the keel
# benchmark (GPT-2 124M, B=16, T=1024, bf16-mixed, with the bf16 matmul rate measured in the same
# run) and the same model in PyTorch, then print a short table last.
#
#   bash bench/gpu_check.sh            # from the repository root or anywhere
#   KEEL_GPU_ARCH=80 bash bench/gpu_check.sh   # an A100
#
# Exit status: 0 when the tests passed and the goals were met, 1 otherwise (the table says which).
set -uo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
arch=${KEEL_GPU_ARCH:-90}
build=build-gpu-check
jobs=$(nproc)
log() { echo "[gpu_check $((SECONDS - start))s] $*"; }

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total \
  --format=csv,noheader
gen=(-G "Unix Makefiles")
command -v ninja >/dev/null && gen=(-G Ninja)
log "configure (${gen[*]}, sm_$arch)"
if ! cmake -S . -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DKEEL_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES="$arch" >"$build.configure.log" 2>&1; then
  tail -30 "$build.configure.log"
  echo "gpu_check: configure failed (missing packages? run scripts/install-deps.sh)"
  exit 1
fi
log "build keel, test_cuda, bench_gpu with -j$jobs"
if ! cmake --build "$build" -j "$jobs" --target keel_cli test_cuda bench_gpu >"$build.build.log" 2>&1; then
  grep -m20 -B2 -A10 "error" "$build.build.log" | head -60
  echo "gpu_check: build failed (full log: $build.build.log)"
  exit 1
fi

log "GPU tests"
export OMP_NUM_THREADS=$jobs
timeout 200 "$build/tests/test_cuda" --gtest_color=no >"$build.tests.log" 2>&1
tests_rc=$?
grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED  \]|Failure|error:" "$build.tests.log" | head -40
tests_line=$(grep -E "^\[  PASSED  \]" "$build.tests.log" | head -1)
failed=$(grep -cE "^\[  FAILED  \] [A-Za-z]" "$build.tests.log")
skipped=$(grep -cE "^\[  SKIPPED \] [A-Za-z]" "$build.tests.log")

dump=$(mktemp -d /tmp/keel-gpu-parity.XXXXXX)
log "keel benchmark"
timeout 150 "$build/bench/bench_gpu" --dump "$dump" 2>&1 | tee "$build.bench.log" | tail -14
keel=$(grep "^RESULT" "$build.bench.log" | tail -1)
log "PyTorch benchmark"
timeout 120 python3 bench/gpt2_torch.py --dump "$dump" 2>&1 | tee "$build.torch.log" | tail -12
torch=$(grep "^RESULT" "$build.torch.log" | tail -1)
rm -rf "$dump"

val() { echo "$1" | tr ' ' '\n' | grep "^$2=" | cut -d= -f2; }
python3 - "$keel" "$torch" "$tests_rc" "$failed" "$skipped" "$tests_line" "$((SECONDS - start))" <<'PY'
import sys
keel, torch, rc, failed, skipped, line, secs = sys.argv[1:8]
def kv(s):
    return dict(p.split("=", 1) for p in s.split()[1:] if "=" in p)
k, t = kv(keel), kv(torch)
ok = rc == "0" and failed == "0" and skipped == "0"
rows = [("GPU tests", f"{'pass' if ok else 'FAIL'} ({line.strip() or 'no summary'}; "
                      f"{failed} failed, {skipped} skipped)")]
goal = ok
if k:
    rows += [("bf16 matmul (cuBLASLt 8192^3)", f"{float(k['peak_tflops']):.0f} TFLOP/s"),
             ("keel GPT-2 124M B=16 T=1024 bf16-mixed", f"{float(k['keel_tok_s']):,.0f} tok/s "
              f"({float(k['step_ms']):.1f} ms/step, attention {k.get('attention', '?')})"),
             ("  by attention backend", f"flash {float(k.get('flash_tok_s', 0)):,.0f} tok/s, "
              f"eager {float(k.get('eager_tok_s', 0)):,.0f} tok/s"),
             ("keel MFU (vs the measured bf16 rate)", f"{100 * float(k['mfu']):.1f}%  (goal >= 35%)")]
    goal &= float(k["mfu"]) >= 0.35
else:
    rows.append(("keel benchmark", "FAILED (no RESULT line)"))
    goal = False
if t:
    rows.append(("PyTorch same model/batch", f"{float(t['torch_tok_s']):,.0f} tok/s "
                 f"({float(t['step_ms']):.1f} ms/step)"))
    if k:
        ratio = float(k["keel_tok_s"]) / float(t["torch_tok_s"])
        d = abs(float(k["loss0"]) - float(t["loss0"]))
        rows.append(("keel / PyTorch tokens/s", f"{ratio:.2f}x  (goal >= 0.90)"))
        rows.append(("step-0 loss keel | torch", f"{float(k['loss0']):.5f} | {float(t['loss0']):.5f}"
                     f"  (|diff| {d:.1e}, parity if < 1e-2)"))
        goal &= ratio >= 0.9 and d < 1e-2
else:
    rows.append(("PyTorch benchmark", "FAILED (no RESULT line)"))
    goal = False
rows.append(("wall time of this check", f"{secs} s (limit 480 s)"))
w = max(len(r[0]) for r in rows)
print()
print("=" * (w + 40))
for name, value in rows:
    print(f"{name:<{w}}  {value}")
print("=" * (w + 40))
print("RESULT:", "all goals met" if goal else "NOT all goals met")
sys.exit(0 if goal else 1)
PY
