#!/usr/bin/env bash
# One pass of every device check, for a GPU machine (or DEVICE=cpu QUICK=1 as a smoke run).
#
#   OUT=gpu_out GOLDEN=shared/golden bash benchmarks/gpu_check.sh
#
# Steps, most important first, each under `timeout` and inside a global deadline
# (BUDGET_S, default 480 s; a step that would start too late is skipped), each logged and
# continued on failure; a step stopped by its timeout prints its last line of output (for
# pytest, the test that was running):
#   env         torch / GPU / backends
#   golden      golden parity, float32 and bfloat16, every backend, graphs on (GOLDEN dir;
#               skipped with a message when absent)
#   pytest      the device tests (marked cuda) but those marked slow (attention, graphs,
#               engine, fusion, transform), one line per test (-vv)
#   start       `dsv4enc encode` with default options twice, each a new process: start-up
#               (everything outside the encoding loop) and loop rate, cold (empty compile
#               cache) and warm (benchmarks/start_cost.py)
#   profile     device time split into GEMM / attention / other, eager and fused, for
#               --attention auto and grouped, and every attention kernel on the same q, k, v,
#               equal and mixed lengths (benchmarks/gpu_profile.py)
#   bench       model-only throughput at real dims (bf16, 1024x768 photos), eager and
#               --fused, against the matmul ceiling; then the encode pipeline end to end,
#               single file and folder output (device idle, steady rate)
#   pytest_slow the device tests marked slow
#   invariance  one image alone == in mixed batches, bit for bit (bf16, one graph bucket),
#               and what the invariant path costs against the plain one
#   fused       --fused == eager under CUDA graphs, batch-invariant rows
#   transform   the transform on the device == Pillow's, bit for bit, and its device time
#               per 1024x768 image against the model's (--transform device)
#   host        `dsv4enc bench --host` on this machine's cores (null device stage)
#   graphs      CUDA graphs == eager at real dims (random bf16 tower), oversize batch eager
#   backends    each attention backend == SDPA, and vs a float32 reference, at real dims
# Files written to $OUT (at most 7): gpu_check.log (everything), summary.txt, checks.json,
# bench.json, profile.json, host.json, start.json. The steps after bench rarely fit one budget:
# a second call runs them, e.g. STEPS=pytest_slow,invariance,fused,host,graphs,backends.
set -u
cd "$(dirname "$0")/.."

OUT=${OUT:-./gpu_out}
GOLDEN=${GOLDEN:-shared/golden}
DEVICE=${DEVICE:-cuda}
QUICK=${QUICK:-0}          # 1: tiny config and few images (CPU smoke run)
BUDGET_S=${BUDGET_S:-480}  # the whole script ends within this many seconds (plus kill grace)
STEPS=${STEPS:-all}        # or a comma-separated subset of the step names, e.g. bench,profile
BENCH_GRAPHS=${BENCH_GRAPHS:-}    # the bench step's --graphs settings (default on,off; off on CPU)
PY=${PYTHON:-python3}

mkdir -p "$OUT"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 DSV4ENC_GOLDEN="$GOLDEN"
LOG="$OUT/gpu_check.log"
SUMMARY="$OUT/summary.txt"
: >"$LOG"
: >"$SUMMARY"
DEADLINE=$(( $(date +%s) + BUDGET_S ))
WORK=$(mktemp -d)  # generated images: outside $OUT, which brings back a few files only

if [ "$QUICK" = 1 ]; then
    CONFIG=configs/tiny.json; DTYPE=float32; CHECK_IMAGES=6; CHECK_TOKENS=8192
    BENCH_IMAGES=synthetic:640x480:6; BENCH_TOKENS=4096; REPEAT=1; NAIVE=2; PROFILE_IMAGES=2
    HOST_IMAGES=synthetic:1024x768:16; BENCH_GRAPHS=${BENCH_GRAPHS:-off}
    START_IMAGES=8; START_SIZE=96x64; PROFILE_ATTENTION=auto
else
    CONFIG=configs/deepseek-v4-flash.json; DTYPE=bfloat16; CHECK_IMAGES=24; CHECK_TOKENS=32768
    BENCH_IMAGES=synthetic:1024x768:384; BENCH_TOKENS=32768; REPEAT=2; NAIVE=4
    PROFILE_IMAGES=11; HOST_IMAGES=synthetic:1024x768:512; BENCH_GRAPHS=${BENCH_GRAPHS:-on,off}
    START_IMAGES=256; START_SIZE=1024x768; PROFILE_ATTENTION=auto,grouped
fi

# step NAME LIMIT_S CMD...: run CMD with a timeout that also respects the global deadline.
step() {
    local name=$1 limit=$2
    shift 2
    local now left began rc
    if [ "$STEPS" != all ] && [[ ",$STEPS," != *",$name,"* ]]; then
        echo "$name: not selected (STEPS=$STEPS)" >>"$SUMMARY"
        return
    fi
    now=$(date +%s)
    left=$(( DEADLINE - now - 5 ))
    if [ "$left" -lt 20 ]; then
        echo "=== $name: SKIPPED (global deadline)" | tee -a "$LOG"
        echo "$name: skipped (no time left)" >>"$SUMMARY"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
    began=$(date +%s)
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$WORK/step.out" | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    local took=$(( $(date +%s) - began ))
    case $rc in
        0) status=ok ;;
        124|137) status="TIMEOUT after ${took}s, running: $(tail -n 1 "$WORK/step.out" | cut -c1-200)" ;;
        *) status="FAILED (exit $rc)" ;;
    esac
    echo "=== $name: $status in ${took}s" | tee -a "$LOG"
    echo "$name: $status (${took}s)" >>"$SUMMARY"
}

step env 60 $PY - <<EOF
import platform, torch
from dsv4enc.tower.attention import available_backends
print("python", platform.python_version(), "torch", torch.__version__,
      "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0))
dev = torch.device("$DEVICE")
print("attention backends on", dev, available_backends(dev))
try:
    import inspect
    from torch.nn.attention.varlen import varlen_attn
    print("varlen_attn", inspect.signature(varlen_attn))
except ImportError as exc:
    print("no varlen_attn:", exc)
EOF

if [ -f "$GOLDEN/expected.json" ] || [[ "$STEPS" != all && ",$STEPS," != *",golden,"* ]]; then
    step golden 70 $PY benchmarks/device_check.py --device "$DEVICE" --sections golden \
        --golden "$GOLDEN" --json "$OUT/checks_golden.json"
else
    echo "=== golden: SKIPPED, no golden vectors at $GOLDEN (set GOLDEN=dir)" | tee -a "$LOG"
    echo "golden: skipped (no $GOLDEN)" >>"$SUMMARY"
fi

# The device tests (marked cuda), the slow ones in a step of their own; a CPU smoke run
# stands a few CPU tests in for them.
TESTS="tests/test_tower_attention.py tests/test_engine_graphs.py tests/test_engine_engine.py"
TESTS="$TESTS tests/test_tower_fusion.py tests/test_tower_resample.py"
if [ "$DEVICE" = cpu ]; then
    FAST_TESTS="tests/test_tower_attention.py tests/test_engine_graphs.py"; FAST_MARK="not slow"
    SLOW_TESTS="tests/test_tower_fusion.py"; SLOW_MARK="slow"
else
    FAST_TESTS=$TESTS; FAST_MARK="cuda and not slow"; SLOW_TESTS=$TESTS; SLOW_MARK="cuda and slow"
fi
step pytest 100 $PY -m pytest -vv -rfEs -p no:cacheprovider -m "$FAST_MARK" $FAST_TESTS

step start 120 $PY benchmarks/start_cost.py --device "$DEVICE" --config "$CONFIG" \
    --images "$START_IMAGES" --size "$START_SIZE" --variants default --json "$OUT/start.json"

step profile 90 $PY benchmarks/gpu_profile.py --device "$DEVICE" --config "$CONFIG" \
    --dtype "$DTYPE" --images "$PROFILE_IMAGES" --attention "$PROFILE_ATTENTION" \
    --json "$OUT/profile.json"

step bench 240 $PY -m dsv4enc bench --config "$CONFIG" --device "$DEVICE" --dtype "$DTYPE" \
    --images "$BENCH_IMAGES" --batch-tokens "$BENCH_TOKENS" --graphs "$BENCH_GRAPHS" --fused off,on \
    --repeat "$REPEAT" --naive-images "$NAIVE" --e2e --outputs file,folder \
    --workdir "$WORK" --json "$OUT/bench.json"

step pytest_slow 120 $PY -m pytest -vv -rfEs -p no:cacheprovider -m "$SLOW_MARK" $SLOW_TESTS

step invariance 70 $PY benchmarks/device_check.py --device "$DEVICE" --sections invariance \
    --config "$CONFIG" --images "$CHECK_IMAGES" --batch-tokens "$CHECK_TOKENS" \
    --json "$OUT/checks_invariance.json"

step fused 90 $PY benchmarks/device_check.py --device "$DEVICE" --sections fused \
    --config "$CONFIG" --dtype "$DTYPE" --images "$CHECK_IMAGES" \
    --batch-tokens "$CHECK_TOKENS" --json "$OUT/checks_fused.json"

step transform 60 $PY benchmarks/device_check.py --device "$DEVICE" --sections transform \
    --config "$CONFIG" --dtype "$DTYPE" --images "$CHECK_IMAGES" \
    --batch-tokens "$CHECK_TOKENS" --json "$OUT/checks_transform.json"

step host 70 $PY -m dsv4enc bench --host --config "$CONFIG" --images "$HOST_IMAGES" \
    --json "$OUT/host.json"

step graphs 70 $PY benchmarks/device_check.py --device "$DEVICE" --sections graphs \
    --config "$CONFIG" --dtype "$DTYPE" --images "$CHECK_IMAGES" \
    --batch-tokens "$CHECK_TOKENS" --json "$OUT/checks_graphs.json"

step backends 60 $PY benchmarks/device_check.py --device "$DEVICE" --sections backends \
    --config "$CONFIG" --images "$CHECK_IMAGES" --batch-tokens "$CHECK_TOKENS" \
    --json "$OUT/checks_backends.json"

# Merge the per-section check files into one (keeps $OUT within the files that come back).
$PY - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
checks = []
for part in sorted(out.glob("checks_*.json")):
    checks += json.loads(part.read_text())
    part.unlink()
(out / "checks.json").write_text(json.dumps(checks, indent=1))
failed = [c["name"] for c in checks if not c["ok"]]
print(f"checks: {len(checks) - len(failed)}/{len(checks)} passed" + "".join(f"\n  FAILED {n}" for n in failed))
EOF
rm -rf "$WORK"

$PY - "$OUT" >>"$SUMMARY" 2>/dev/null <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
checks = json.loads((out / "checks.json").read_text()) if (out / "checks.json").exists() else []
print(f"checks: {sum(c['ok'] for c in checks)}/{len(checks)} passed")
for c in checks:
    if not c["ok"]:
        print(f"  FAILED {c['name']}: {c['value']:.3g} (limit {c['limit']:g})")
for name in ("bench.json",):
    if (out / name).exists():
        for r in json.loads((out / name).read_text()):
            if r.get("mode") == "meta":
                print(f"{name}: {r['device']} {r['dtype']} ceiling {r['matmul_ceiling']/1e12:.1f} "
                      f"TFLOP/s, square {r['matmul_square']/1e12:.1f}, "
                      f"{r['gflop_per_image']:.0f} GFLOP/image")
            else:
                frac = r.get("ceiling_frac")
                print(f"{name}: {r['mode']} {r.get('output') or ''} graphs={r.get('graphs')} "
                      f"fused={r.get('fused')} budget={r.get('batch_tokens')} "
                      f"{r['img_s']:.1f} img/s"
                      + (f", {frac:.0%} of ceiling" if frac is not None else "")
                      + (f" ({r['peak_frac']:.0%} of square peak)" if r.get("peak_frac") else "")
                      + (f", device idle {r['device_idle']:.0%}" if r.get("device_idle") is not None else "")
                      + (f", steady {r['steady_img_s']:.1f} img/s" if r.get("steady_img_s") else "")
                      + f", padding {r.get('padding') or 0:.1%}, x{r['vs_naive']:.2f} naive")
if (out / "host.json").exists():
    for r in json.loads((out / "host.json").read_text()):
        print(f"host.json: {r['output']} {r['img_s']:.1f} img/s on {r['cores']} cores "
              f"({r['workers']} decode workers) = {r['img_s_per_core']:.1f} per core, "
              f"{r['img_per_cpu_s']:.1f} images per CPU-second"
              + (f", steady {r['steady_img_per_cpu_s']:.1f}"
                 if r.get("steady_img_per_cpu_s") else ""))
if (out / "start.json").exists():
    for r in json.loads((out / "start.json").read_text()):
        print(f"start.json: {r['variant']} {r['run']}: start-up {r['start_s']:.1f} s, loop "
              f"{r['loop_img_per_s']:.1f} img/s, whole run {r['wall_s']:.1f} s")
if (out / "profile.json").exists():
    for r in json.loads((out / "profile.json").read_text()):
        if r["section"] == "mixed":
            print(f"profile.json: mixed lengths, attention {r['kernel']} {r['tflop_s']:.0f} TFLOP/s")
        elif r["section"] == "breakdown":
            print(f"profile.json: {r['variant']} {r['img_s']:.1f} img/s, {r['tflop_s']:.0f} TFLOP/s; "
                  + ", ".join(f"{c} {r[c + '_s'] / max(r['kernels_s'], 1e-12):.0%}"
                              + (f" at {r[c + '_tflop_s']:.0f} TFLOP/s" if r.get(c + '_tflop_s') else "")
                              for c in ("gemm", "attention", "other")))
        else:
            print(f"profile.json: attention {r['kernel']} {r['tflop_s']:.0f} TFLOP/s")
EOF
echo "--- summary ($(date -u +%FT%TZ))" | tee -a "$LOG"
tee -a "$LOG" <"$SUMMARY"
