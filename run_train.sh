#!/usr/bin/env bash
# Launch weft training on this host, or on one node of several.
#   NGPU         processes on this node (default: visible GPUs, or 1 without GPUs)
#   CONFIG_FILE  TOML config (default: train_configs/debug_model.toml)
#   LOG_RANK     local rank whose output is shown (default: 0)
#   PYTHON       interpreter (default: python3)
#   PYTORCH_ALLOC_CONF  CUDA caching-allocator settings (default: expandable_segments:True,
#                unless it or the older PYTORCH_CUDA_ALLOC_CONF is already set)
#   COMM_MODE    fake_backend: a dry run instead of training. One CPU process simulates NGPU ranks
#                (NNODES x NGPU with NNODES set), prints the plan, the memory per GPU and a
#                step-time estimate, and exits; no torchrun, no GPU (docs/planning.md)
# Several nodes (run the same command on every node; docs/planning.md, scripts/slurm/train.sbatch):
#   NNODES       number of nodes (default: 1)
#   NODE_RANK    this node's index, 0 .. NNODES-1 (node 0 checks the config and reports mistakes)
#   MASTER_ADDR  host name or address of node 0, reachable from every node
#   MASTER_PORT  a free port on node 0 (default: 29500)
#   RDZV_ID      rendezvous id shared by the nodes of one job (default: weft)
#   RDZV_BACKEND c10d (default: nodes join in any order) or static (ranks follow NODE_RANK)
# Extra arguments are config overrides, e.g. --training.steps 20
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
if [ -z "${NGPU:-}" ]; then
  NGPU=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() or 1)' 2>/dev/null || echo 1)
fi
CONFIG_FILE=${CONFIG_FILE:-train_configs/debug_model.toml}
LOG_RANK=${LOG_RANK:-0}
NNODES=${NNODES:-1}
COMM_MODE=${COMM_MODE:-}
WORLD_SIZE=$((NNODES * NGPU))

if [ -n "$COMM_MODE" ]; then
  if [ "$COMM_MODE" != "fake_backend" ]; then
    echo "run_train.sh: COMM_MODE must be empty (train) or fake_backend (dry run), got '$COMM_MODE'" >&2
    exit 2
  fi
  # LOCAL_WORLD_SIZE: GPUs per node, for the warning when tp would cross nodes.
  LOCAL_WORLD_SIZE="$NGPU" exec "$PYTHON" train.py --job.config_file "$CONFIG_FILE" --comm.mode fake_backend \
    --comm.fake_world_size "$WORLD_SIZE" "$@"
fi

export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
export TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}
# Expandable segments let the allocator grow a segment instead of caching many fixed-size
# ones that fragment: 5 GiB less reserved at 3B with op SAC on an H200 (docs/performance.md).
if [ -z "${PYTORCH_ALLOC_CONF:-}" ] && [ -z "${PYTORCH_CUDA_ALLOC_CONF:-}" ]; then
  export PYTORCH_ALLOC_CONF=expandable_segments:True
fi
if [ "$NNODES" -eq 1 ]; then
  NODE_RANK=0
  RDZV=(--rdzv_backend c10d --rdzv_endpoint "localhost:0")
else
  : "${NODE_RANK:?set NODE_RANK (0 .. NNODES-1) on every node}"
  : "${MASTER_ADDR:?set MASTER_ADDR to node 0 (reachable from every node)}"
  RDZV_BACKEND=${RDZV_BACKEND:-c10d}
  RDZV=(--nnodes "$NNODES" --rdzv-backend "$RDZV_BACKEND" --rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}"
        --rdzv-id "${RDZV_ID:-weft}")
  # torchrun uses the node rank with the static backend only (and warns that c10d ignores it).
  if [ "$RDZV_BACKEND" = "static" ]; then RDZV+=(--node-rank "$NODE_RANK"); fi
fi
# Check the config for the whole world first, so a mistake is one line (from node 0) instead of
# one per rank plus torchrun's failure report. Only node 0 checks as rank 0 (which takes the
# dump-folder lock for a moment): another node doing so could find node 0's run holding it.
WEFT_CHECK_CONFIG_ONLY=1 WORLD_SIZE="$WORLD_SIZE" LOCAL_WORLD_SIZE="$NGPU" RANK="$NODE_RANK" \
  "$PYTHON" train.py --job.config_file "$CONFIG_FILE" "$@"
exec "$PYTHON" -m torch.distributed.run --nproc_per_node="$NGPU" "${RDZV[@]}" \
  --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
  train.py --job.config_file "$CONFIG_FILE" "$@"
