#!/usr/bin/env bash
# One batched GPU session (device tool or any GPU machine): tests, node check, benchmarks.
# Usage: [WARMUP=llama-3-8b] bash scripts/gpu_session.sh [bench names...]   (default: the kernel benches;
#        train_step: scripts/bench_train_step.py, give it BENCH_TIMEOUT=480; none: no benches)
# Environment: CHECK=0 skips `liger-portable check`; DEMO=1 runs `liger-portable demo`;
#        WARMUP_ARGS, WARMUP_TIMEOUT (default 600 s);
#        TESTS=0 skips the GPU tests (TESTS='tests/test_rope.py' runs only those), TEST_TIMEOUT (default
#        330 s: the 2**31-element tests run last, one at a time, after every other GPU test),
#        TEST_WORKERS (default 8); BENCH_ARGS for every bench, BENCH_ARGS_<name> for one
#        (e.g. BENCH_ARGS_rope='--shapes hd64'), BENCH_TIMEOUT (default 120 s a bench). A name given as
#        cross_entropy:--sweep,--shapes,8192x128256 runs that bench with those arguments.
# Logs and JSON results are collected in one archive, $OUT/session.tgz (the device tool returns
# at most 8 files), or left in scripts/results/latest/ without $OUT.
set -uo pipefail
. scripts/session_env.sh gpu_session scripts/results/latest   # OUT, FINAL, wheels from .whl/, PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m liger_portable info 2>&1 | tee "$OUT/info.txt"
[ "${CHECK:-1}" != 0 ] && python3 -m liger_portable check 2>&1 | tee "$OUT/check.txt"
if [ "${TESTS:-tests/}" != 0 ]; then
  # -v: a line per test in pytest_gpu_full.txt, so a run cut by the timeout still names its failures
  timeout -s INT -k 20 "${TEST_TIMEOUT:-330}" python3 -m pytest -v -rfE -n "${TEST_WORKERS:-8}" -m gpu -p no:cacheprovider \
    --durations=25 ${TESTS:-tests/} 2>&1 | tee "$OUT/pytest_gpu_full.txt" | grep -v "PASSED\|SKIPPED" | tail -80 | tee "$OUT/pytest_gpu.txt"
fi
if [ "${DEMO:-0}" != 0 ]; then   # the README's main job on this GPU
  timeout "${DEMO_TIMEOUT:-300}" python3 -m liger_portable demo 2>&1 | tee "$OUT/demo.txt" | tail -30
fi
if [ -n "${WARMUP:-}" ]; then   # e.g. WARMUP=llama-3-8b: time the warmup, keep the cache it wrote
  export LIGER_PORTABLE_CACHE_DIR=/tmp/lp_warmup_cache
  rm -rf "$LIGER_PORTABLE_CACHE_DIR"
  timeout "${WARMUP_TIMEOUT:-600}" python3 -m liger_portable warmup "$WARMUP" ${WARMUP_ARGS:-} 2>&1 | tee "$OUT/warmup.txt" | tail -60
  cp "$LIGER_PORTABLE_CACHE_DIR"/*.json "$OUT/" 2>/dev/null
  timeout "${WARMUP_TIMEOUT:-600}" python3 -m liger_portable warmup "$WARMUP" ${WARMUP_ARGS:-} 2>&1 | tail -3 \
    | tee "$OUT/warmup_rerun.txt"  # must be a no-op
  unset LIGER_PORTABLE_CACHE_DIR
fi
names=("$@")
[ ${#names[@]} -eq 0 ] && names=(rms_norm layer_norm fused_add_rms_norm glu rope)
[ "${names[0]}" = none ] && names=()   # `gpu_session.sh none`: no benchmarks
for spec in "${names[@]}"; do   # a name, or name:--arg,value,... for a run with its own arguments
  n=${spec%%:*}; extra=""; tag=""
  if [[ $spec == *:* ]]; then extra=${spec#*:}; extra=${extra//,/ }; tag=_$(echo "$extra" | tr -cd 'a-z0-9'); fi
  args_var="BENCH_ARGS_$n"
  (cd scripts && timeout "${BENCH_TIMEOUT:-120}" python3 "bench_$n.py" ${BENCH_ARGS:-} ${!args_var:-} $extra) 2>&1 \
    | tee "$OUT/bench_$n$tag.txt" | tail -40
done
[ -n "$FINAL" ] && tar czf "$FINAL/session.tgz" -C "$OUT" .
