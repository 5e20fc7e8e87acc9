#!/usr/bin/env bash
# The CPU benchmark recorded in RESULTS.md: medium config, float32, the 24-photo mix,
# model-only, the naive loop, the end-to-end pipeline in-process and `dsv4enc encode` as a
# fresh process (start-up included). Run it on an otherwise idle machine
# (every number is best-of-repeats, but a busy core still skews the ratios).
#
#   bash benchmarks/cpu_bench.sh [extra python -m dsv4enc bench flags]
set -eu
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m dsv4enc bench --config configs/medium.json --device cpu \
    --dtype float32 --images synthetic:mix --batch-tokens 8192 --repeat 3 --e2e --cli "$@"
