#!/usr/bin/env bash
# Launch weft training on this host.
#   NGPU         processes to start (default: visible GPUs, or 1 without GPUs)
#   CONFIG_FILE  TOML config (default: train_configs/debug_model.toml)
#   LOG_RANK     rank whose output is shown (default: 0)
#   PYTHON       interpreter (default: python3)
#   PYTORCH_ALLOC_CONF  CUDA caching-allocator settings (default: expandable_segments:True,
#                unless it or the older PYTORCH_CUDA_ALLOC_CONF is already set)
# Extra arguments are config overrides, e.g. --training.steps 20
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
if [ -z "${NGPU:-}" ]; then
  NGPU=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() or 1)' 2>/dev/null || echo 1)
fi
CONFIG_FILE=${CONFIG_FILE:-train_configs/debug_model.toml}
LOG_RANK=${LOG_RANK:-0}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
# Expandable segments let the allocator grow a segment instead of caching many fixed-size
# ones that fragment: 5 GiB less reserved at 3B with op SAC on an H200 (docs/performance.md).
if [ -z "${PYTORCH_ALLOC_CONF:-}" ] && [ -z "${PYTORCH_CUDA_ALLOC_CONF:-}" ]; then
  export PYTORCH_ALLOC_CONF=expandable_segments:True
fi
# Check the config for this world size first, so a mistake is one line instead of one per
# rank plus torchrun's failure report.
WEFT_CHECK_CONFIG_ONLY=1 WORLD_SIZE="$NGPU" RANK=0 "$PYTHON" train.py --job.config_file "$CONFIG_FILE" "$@"
exec "$PYTHON" -m torch.distributed.run --nproc_per_node="$NGPU" --rdzv_backend c10d \
  --rdzv_endpoint="localhost:0" --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
  train.py --job.config_file "$CONFIG_FILE" "$@"
