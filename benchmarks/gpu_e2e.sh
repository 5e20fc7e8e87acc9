#!/usr/bin/env bash
# The encode command end to end at real dims on a GPU machine: random bf16 tower, N generated
# 1024x768 photos, single-file and folder output. Prints each run's summary (time split,
# steady rate via the encode loop). Writes to $OUT (default ./gpu_out3). EXTRA: more encode
# options (e.g. EXTRA=--fused); LIMIT: seconds per encode (default 60).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-./gpu_out3}
N=${N:-256}
mkdir -p "$OUT"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
WORK=$(mktemp -d)
$PY - "$WORK/images" "$N" <<'PYEOF'
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from dsv4enc.bench.throughput import synthetic_images
folder, n = Path(sys.argv[1]), int(sys.argv[2])
with ProcessPoolExecutor(16) as pool:  # each worker writes its own share of the images
    list(pool.map(synthetic_images, [folder / f"s{i}" for i in range(16)],
                  [f"1024x768:{n // 16}"] * 16, range(16)))
PYEOF
i=0
for out in "$WORK/emb.parquet" "$WORK/emb_dir/"; do
    i=$((i + 1))
    /usr/bin/time -f "wall %e s" timeout -k 5 "${LIMIT:-60}" $PY -m dsv4enc encode "$WORK/images" \
        --out "$out" --config configs/deepseek-v4-flash.json --random-init --device cuda --quiet \
        --dtype bfloat16 --summary-json "$OUT/summary$i.json" ${EXTRA:-} 2>&1 | tee -a "$OUT/e2e.txt"
done
rm -rf "$WORK"
