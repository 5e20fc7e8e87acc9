#!/usr/bin/env bash
# A short second pass for a GPU machine, after gpu_check.sh: the backend checks with
# depth-aware limits, graphs vs eager with fitted budgets, and the end-to-end pipeline at real
# dims (steady-state rate and device idle). Writes to $OUT (default ./gpu_out2).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-./gpu_out2}
mkdir -p "$OUT"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
CONFIG=configs/deepseek-v4-flash.json
{
timeout -k 5 50 $PY benchmarks/device_check.py --device cuda --sections backends \
    --config "$CONFIG" --images 24 --batch-tokens 32768 --json "$OUT/checks_backends.json"
timeout -k 5 80 $PY -m dsv4enc bench --config "$CONFIG" --device cuda --dtype bfloat16 \
    --images synthetic:1024x768:128 --batch-tokens 16384,32768 --graphs on,off --repeat 2 \
    --naive-images 4 --workdir "$OUT/.work" --json "$OUT/bench.json"
timeout -k 5 130 $PY -m dsv4enc bench --config "$CONFIG" --device cuda --dtype bfloat16 \
    --images synthetic:1024x768:384 --batch-tokens 32768 --graphs auto --repeat 1 \
    --naive-images 2 --e2e --workdir "$OUT/.work" --json "$OUT/e2e.json"
} 2>&1 | grep -v "^INFO dsv4enc.graphs: captured CUDA graph:" | tee "$OUT/log.txt"
rm -rf "$OUT/.work"
