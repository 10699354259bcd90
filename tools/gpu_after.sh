#!/usr/bin/env bash
# The benchmarks of a lent GPU run, after tools/gpu_suite.sh's tests: `AFTER="bash tools/gpu_after.sh"`.
# Apex's tests of the kernels, the norm read at several tilings (benchmarks/gpu/norm_read.py), then the
# GPU report's sections that the norm kernel and the guard change, rewritten into $OUT/docs (copy them
# back by hand). About 4 minutes on an H200.
set -u
python3 -m pytest -p no:cacheprovider -p no:benchmark -q -m apex -n 8 --timeout 100 \
  tests/unit/kernels tests/unit/clipping tests/unit/scaler 2>&1 | tail -15
python3 benchmarks/gpu/norm_read.py --device cuda --json "$OUT/norm_read.json" 2>&1 | tail -40
mkdir -p "$OUT/docs/img" && cp docs/benchmarks-gpu.md "$OUT/docs/" && cp -r docs/img/benchmarks-gpu "$OUT/docs/img/"
python3 benchmarks/report.py --device cuda --only step_overhead.py fp8.py training_speed.py --update \
  --out-dir "$OUT/docs" --budget 250 --json "$OUT/report.json" 2>&1 | tail -40
