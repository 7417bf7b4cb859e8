#!/usr/bin/env bash
# One batched GPU session (device tool or any GPU machine): tests, node check, benchmarks.
# Usage: [WARMUP=llama-3-8b] bash scripts/gpu_session.sh [bench names...]   (default: the kernel benches;
#        train_step: scripts/bench_train_step.py, give it BENCH_TIMEOUT=480)
# Logs and JSON results are collected in one archive, $OUT/session.tgz (the device tool returns
# at most 8 files), or left in scripts/results/latest/ without $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
FINAL=${OUT:-}
export OUT=/tmp/gpu_session
[ -z "$FINAL" ] && OUT=scripts/results/latest
rm -rf "$OUT" && mkdir -p "$OUT"
if [ -d .whl ]; then   # peers to benchmark against, carried as wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m liger_portable info 2>&1 | tee "$OUT/info.txt"
python3 -m liger_portable check 2>&1 | tee "$OUT/check.txt"
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -n 4 -m gpu -p no:cacheprovider tests/ 2>&1 | tail -30 | tee "$OUT/pytest_gpu.txt"
if [ -n "${WARMUP:-}" ]; then   # e.g. WARMUP=llama-3-8b: time the warmup, keep the cache it wrote
  export LIGER_PORTABLE_CACHE_DIR=/tmp/lp_warmup_cache
  rm -rf "$LIGER_PORTABLE_CACHE_DIR"
  python3 -m liger_portable warmup "$WARMUP" ${WARMUP_ARGS:-} 2>&1 | tee "$OUT/warmup.txt" | tail -60
  cp "$LIGER_PORTABLE_CACHE_DIR"/*.json "$OUT/" 2>/dev/null
  python3 -m liger_portable warmup "$WARMUP" ${WARMUP_ARGS:-} 2>&1 | tail -3 | tee "$OUT/warmup_rerun.txt"  # must be a no-op
  unset LIGER_PORTABLE_CACHE_DIR
fi
names=("$@")
[ ${#names[@]} -eq 0 ] && names=(rms_norm layer_norm fused_add_rms_norm glu rope)
for n in "${names[@]}"; do
  (cd scripts && timeout "${BENCH_TIMEOUT:-120}" python3 "bench_$n.py" ${BENCH_ARGS:-}) 2>&1 | tee "$OUT/bench_$n.txt" | tail -40
done
[ -n "$FINAL" ] && tar czf "$FINAL/session.tgz" -C "$OUT" .
