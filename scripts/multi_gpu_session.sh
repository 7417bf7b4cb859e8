#!/usr/bin/env bash
# The two-GPU runs of the multi-GPU issue, batched for one call on a 2-GPU machine
# (device tool kind nvidia-h200-x2, or any node with 2 GPUs):
#   1. scripts/distributed_check.py under torchrun over NCCL: DTensor norms, FSDP2 norm gradients,
#      a patched tiny Llama under DDP and FSDP2 against the single-GPU run (fp32 and bf16);
#   2. run-time rank agreement: LIGER_PORTABLE_AUTOTUNE=1 with an empty cache, both ranks train
#      under DDP, then compare every resolved config and count who tuned what (check "autotune
#      agreement" of distributed_check.py);
#   3. torchrun of the warmup script: one cache file that both ranks agree on.
# Needs transformers (wheels in .whl/ are installed to /tmp/site when present).
# Usage: bash scripts/multi_gpu_session.sh     -> $OUT/multi_gpu.tgz (or scripts/results/latest_multi/)
set -uo pipefail
. scripts/session_env.sh multi_gpu_session scripts/results/latest_multi   # OUT, FINAL, wheels from .whl/, PYTHONPATH
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
TR="python3 -m torch.distributed.run --standalone --nproc-per-node 2"
timeout 300 $TR scripts/distributed_check.py --json "$OUT/distributed_check.json" 2>&1 | tee "$OUT/distributed_check.txt" | grep -E "^(ok|FAIL)"
export LIGER_PORTABLE_CACHE_DIR=/tmp/lp_cache_autotune
rm -rf "$LIGER_PORTABLE_CACHE_DIR"
LIGER_PORTABLE_AUTOTUNE=1 timeout 300 $TR scripts/distributed_check.py --checks ddp --dtype bfloat16 --steps 3 \
  --json "$OUT/autotune_ddp.json" 2>&1 | tee "$OUT/autotune_ddp.txt" | grep -E "^(ok|FAIL)"
cp -r "$LIGER_PORTABLE_CACHE_DIR" "$OUT/autotune_cache_runtime" 2>/dev/null
export LIGER_PORTABLE_CACHE_DIR=/tmp/lp_cache_warmup
rm -rf "$LIGER_PORTABLE_CACHE_DIR"
timeout 300 $TR scripts/autotune_warmup.py llama-3.2-1b --tokens 8192 2>&1 | tee "$OUT/warmup_torchrun.txt" | tail -30
cp -r "$LIGER_PORTABLE_CACHE_DIR" "$OUT/autotune_cache_warmup" 2>/dev/null
[ -n "$FINAL" ] && tar czf "$FINAL/multi_gpu.tgz" -C "$OUT" .
