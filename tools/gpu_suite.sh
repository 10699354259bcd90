#!/usr/bin/env bash
# The test suite, then benchmarks on a quiet GPU, on a lent GPU machine in one call, with every
# test outcome and traceback streamed to $OUT (tools/stream_report.py), so a run cut at its limit
# still says what failed. Before the call, here: `bash ../shared/gpu/prepare.sh APEX_GIT_DIR` (it
# fills the git-ignored .gpu/ with Apex's sources and .whl/ with torchao). The call: command
# `bash tools/gpu_suite.sh`, carry [".gpu", ".whl"]. amp_C builds while the suite runs; the
# cuda/apex-marked tests then run beside it. Settings (environment):
#   TESTS    what pytest runs (default: the whole suite, apex-marked tests apart); "none" skips it
#   SUITE_S / CUDA_S   the suite's and the cuda/apex tests' time limits in seconds
#   CUDA=0   skip the cuda/apex-marked tests
#   MAX_JOBS the amp_C build's compile jobs (default 4: the suite runs beside it)
#   AFTER    a shell command run once the tests are done, with amp_C on PYTHONPATH (benchmarks:
#            tools/gpu_after.sh)
set -u
export PYTHONUNBUFFERED=1 PYTHONHASHSEED=0
root=$(pwd); OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; export OUT
t0=$(date +%s); log() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
{
log machine; nvidia-smi -L
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || log "no torchao"
( MAX_JOBS=${MAX_JOBS:-4} TORCH_CUDA_ARCH_LIST="$(python3 -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')" \
  timeout 200 python3 .gpu/build_amp_c.py .gpu/apex_src /tmp/ampc > "$OUT/build.log" 2>&1; echo "build rc=$?" >> "$OUT/build.log"
  log "amp_C built"
  [ "${CUDA:-1}" = 0 ] && exit 0
  log "cuda tests"
  PYTHONPATH=$root:/tmp/site:/tmp/ampc:$root/.gpu/apex_src:$root/tools STREAM_TAG=cuda timeout -s INT -k 15 ${CUDA_S:-250} \
    python3 -m pytest -p no:cacheprovider -p no:benchmark -p stream_report -n 4 --timeout 100 -m "cuda or apex" -q --tb=short -rfE \
    --durations=15 > "$OUT/cuda.txt" 2>&1
  log "cuda rc=$?" ) &
side=$!
if [ "${TESTS:-}" != none ]; then
  log "suite: ${TESTS:-all}"
  # shellcheck disable=SC2086
  PYTHONPATH=$root:/tmp/site:$root/tools timeout -s INT -k 15 ${SUITE_S:-300} python3 -m pytest -p no:cacheprovider -p no:benchmark \
    -p stream_report -n 11 --timeout 200 -m "not apex" -q --tb=short -rfE --durations=25 ${TESTS:-} > "$OUT/suite.txt" 2>&1
  log "suite rc=$?"
fi
wait $side
grep -c . "$OUT"/*-done.txt; grep -E "^(failed|error)" "$OUT"/*-done.txt | cut -c1-250
if [ -n "${AFTER:-}" ]; then
  log "after: $AFTER"
  PYTHONPATH=$root:/tmp/site:/tmp/ampc:$root/.gpu/apex_src bash -c "$AFTER" 2>&1
  log "after rc=$?"
fi
log done
} 2>&1 | tee "$OUT/log.txt"
