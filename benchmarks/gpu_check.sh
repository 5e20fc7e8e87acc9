#!/usr/bin/env bash
# One pass of every device check, for a GPU machine (or DEVICE=cpu QUICK=1 as a smoke run).
#
#   OUT=gpu_out GOLDEN=shared/golden bash benchmarks/gpu_check.sh
#
# Steps, in order of importance, each under `timeout` and inside a global deadline
# (BUDGET_S, default 450 s), each logged and continued on failure:
#   env       torch / GPU / backends
#   golden    golden parity, float32 and bfloat16, every backend, graphs on (GOLDEN dir;
#             skipped with a message when absent)
#   graphs    CUDA graphs == eager at real dims (random bf16 tower), oversize batch eager
#   backends  each attention backend == SDPA, and vs a float32 reference, at real dims
#   invariance  one image alone == in mixed batches, bit for bit (bf16, one graph bucket),
#             and what the invariant path costs against the plain one
#   fused     --fused (compiled RMSNorm/RoPE/SwiGLU) == eager under graphs, invariant, speed
#   pytest    the CUDA tests (attention, graphs, engine; golden tests if GOLDEN exists)
#   bench     throughput at real dims: bf16, 1024x768 photos, graphs on/off per budget
#   e2e       the full encode pipeline on the same photos (optional, last)
# Files written to $OUT (at most 5): gpu_check.log (everything), summary.txt,
# checks.json, bench.json, e2e.json.
set -u
cd "$(dirname "$0")/.."

OUT=${OUT:-./gpu_out}
GOLDEN=${GOLDEN:-shared/golden}
DEVICE=${DEVICE:-cuda}
QUICK=${QUICK:-0}          # 1: tiny config and few images (CPU smoke run)
BUDGET_S=${BUDGET_S:-450}  # the whole script ends within this many seconds (plus kill grace)
PY=${PYTHON:-python3}

mkdir -p "$OUT"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 DSV4ENC_GOLDEN="$GOLDEN"
LOG="$OUT/gpu_check.log"
SUMMARY="$OUT/summary.txt"
: >"$LOG"
: >"$SUMMARY"
DEADLINE=$(( $(date +%s) + BUDGET_S ))

if [ "$QUICK" = 1 ]; then
    CONFIG=configs/tiny.json; DTYPE=float32; CHECK_IMAGES=6; CHECK_TOKENS=8192
    BENCH_IMAGES=synthetic:640x480:6; BENCH_TOKENS=4096; GRAPHS=auto; REPEAT=1; NAIVE=2
else
    CONFIG=configs/deepseek-v4-flash.json; DTYPE=bfloat16; CHECK_IMAGES=24; CHECK_TOKENS=32768
    BENCH_IMAGES=synthetic:1024x768:128; BENCH_TOKENS=8192,16384,32768; GRAPHS=on,off
    REPEAT=2; NAIVE=8
fi

# step NAME LIMIT_S CMD...: run CMD with a timeout that also respects the global deadline.
step() {
    local name=$1 limit=$2
    shift 2
    local now left began rc
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
    timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    local took=$(( $(date +%s) - began ))
    case $rc in
        0) status=ok ;;
        124|137) status="TIMEOUT after ${took}s" ;;
        *) status="FAILED (exit $rc)" ;;
    esac
    echo "=== $name: $status in ${took}s" | tee -a "$LOG"
    echo "$name: $status (${took}s)" >>"$SUMMARY"
}

step env 60 $PY - <<EOF
import platform, torch
from dsv4enc.attention import available_backends
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

if [ -f "$GOLDEN/expected.json" ]; then
    step golden 90 $PY benchmarks/device_check.py --device "$DEVICE" --sections golden \
        --golden "$GOLDEN" --json "$OUT/checks_golden.json"
else
    echo "=== golden: SKIPPED, no golden vectors at $GOLDEN (set GOLDEN=dir)" | tee -a "$LOG"
    echo "golden: skipped (no $GOLDEN)" >>"$SUMMARY"
fi

step graphs 120 $PY benchmarks/device_check.py --device "$DEVICE" --sections graphs \
    --config "$CONFIG" --dtype "$DTYPE" --images "$CHECK_IMAGES" \
    --batch-tokens "$CHECK_TOKENS" --json "$OUT/checks_graphs.json"

step backends 90 $PY benchmarks/device_check.py --device "$DEVICE" --sections backends \
    --config "$CONFIG" --images "$CHECK_IMAGES" --batch-tokens "$CHECK_TOKENS" \
    --json "$OUT/checks_backends.json"

step invariance 90 $PY benchmarks/device_check.py --device "$DEVICE" --sections invariance \
    --config "$CONFIG" --images "$CHECK_IMAGES" --batch-tokens "$CHECK_TOKENS" \
    --json "$OUT/checks_invariance.json"

step fused 120 $PY benchmarks/device_check.py --device "$DEVICE" --sections fused \
    --config "$CONFIG" --dtype "$DTYPE" --images "$CHECK_IMAGES" \
    --batch-tokens "$CHECK_TOKENS" --json "$OUT/checks_fused.json"

TESTS="tests/test_attention.py tests/test_graphs.py tests/test_engine.py"
[ -f "$GOLDEN/expected.json" ] && [ -f tests/test_golden.py ] && TESTS="$TESTS tests/test_golden.py"
step pytest 120 $PY -m pytest -x -q -p no:cacheprovider $TESTS

step bench 200 $PY -m dsv4enc bench --config "$CONFIG" --device "$DEVICE" --dtype "$DTYPE" \
    --images "$BENCH_IMAGES" --batch-tokens "$BENCH_TOKENS" --graphs "$GRAPHS" \
    --repeat "$REPEAT" --naive-images "$NAIVE" --workdir "$OUT/.work" --json "$OUT/bench.json"

E2E_IMAGES=${E2E_IMAGES:-$BENCH_IMAGES}
[ "$QUICK" = 1 ] || E2E_IMAGES=synthetic:1024x768:512
step e2e 150 $PY -m dsv4enc bench --config "$CONFIG" --device "$DEVICE" --dtype "$DTYPE" \
    --images "$E2E_IMAGES" --batch-tokens "${BENCH_TOKENS##*,}" --graphs auto --repeat 1 \
    --naive-images "$NAIVE" --e2e --workdir "$OUT/.work" --json "$OUT/e2e.json"

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
rm -rf "$OUT/.work"

$PY - "$OUT" >>"$SUMMARY" 2>/dev/null <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
checks = json.loads((out / "checks.json").read_text()) if (out / "checks.json").exists() else []
print(f"checks: {sum(c['ok'] for c in checks)}/{len(checks)} passed")
for c in checks:
    if not c["ok"]:
        print(f"  FAILED {c['name']}: {c['value']:.3g} (limit {c['limit']:g})")
for name in ("bench.json", "e2e.json"):
    if (out / name).exists():
        for r in json.loads((out / name).read_text()):
            if r.get("mode") == "meta":
                print(f"{name}: {r['device']} {r['dtype']} ceiling {r['matmul_ceiling']/1e12:.1f} "
                      f"TFLOP/s, square {r['matmul_square']/1e12:.1f}, "
                      f"{r['gflop_per_image']:.0f} GFLOP/image")
            else:
                frac = r.get("ceiling_frac")
                print(f"{name}: {r['mode']} graphs={r.get('graphs')} budget={r.get('batch_tokens')} "
                      f"{r['img_s']:.1f} img/s"
                      + (f", {frac:.0%} of ceiling" if frac is not None else "")
                      + (f" ({r['peak_frac']:.0%} of square peak)" if r.get("peak_frac") else "")
                      + (f", device idle {r['device_idle']:.0%}" if r.get("device_idle") is not None else "")
                      + (f", steady {r['steady_img_s']:.1f} img/s" if r.get("steady_img_s") else "")
                      + f", padding {r.get('padding') or 0:.1%}, x{r['vs_naive']:.2f} naive")
EOF
echo "--- summary ($(date -u +%FT%TZ))" | tee -a "$LOG"
tee -a "$LOG" <"$SUMMARY"
