#!/usr/bin/env bash
# Launch `vlmfast train` on every GPU of this machine, or of several machines, with torchrun (DDP; DeepSpeed or
# FSDP2 when the config enables them). Without a GPU it starts 2 CPU processes (gloo), which is how CI runs it.
#
# Usage:
#   bash examples/launch_multi_gpu.sh [CONFIG] [--steps N] [vlmfast train arguments ...]
#   bash examples/launch_multi_gpu.sh examples/configs/ddp_comm_hook.yaml --set precision=bf16
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash examples/launch_multi_gpu.sh run.yaml     # on node 0
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 bash examples/launch_multi_gpu.sh run.yaml     # on node 1
#
# Environment (all optional):
#   NPROC_PER_NODE  processes per machine (default: the number of GPUs, or 2 without one)
#   NNODES          machines in the job (default 1: a standalone rendezvous on this machine)
#   NODE_RANK       this machine's index, 0 .. NNODES-1 (default 0)
#   MASTER_ADDR     address of the NODE_RANK 0 machine, reachable from all (required when NNODES > 1)
#   MASTER_PORT     a free TCP port on it (default 29500)
#   PYTHON          the interpreter with vlmfast installed (default: python)
# The launcher (torchrun) then sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for each process.
# Under SLURM: NNODES=$SLURM_NNODES NODE_RANK=$SLURM_NODEID, MASTER_ADDR = the first host of $SLURM_JOB_NODELIST.
set -euo pipefail

PYTHON=${PYTHON:-python}
NPROC_PER_NODE=${NPROC_PER_NODE:-$("$PYTHON" -c "import torch; print(torch.cuda.device_count() or 2)")}
NNODES=${NNODES:-1}

args=()
while (($#)); do
  case "$1" in
    --steps) args+=(--set "max_steps=$2"); shift 2 ;;
    --steps=*) args+=(--set "max_steps=${1#--steps=}"); shift ;;
    *) args+=("$1"); shift ;;
  esac
done

if [[ "$NNODES" == 1 ]]; then
  rendezvous=(--standalone)
else
  : "${MASTER_ADDR:?set MASTER_ADDR to the address of the NODE_RANK 0 machine}"
  rendezvous=(--nnodes "$NNODES" --node_rank "${NODE_RANK:-0}" --master_addr "$MASTER_ADDR"
              --master_port "${MASTER_PORT:-29500}")
fi

exec "$PYTHON" -m torch.distributed.run "${rendezvous[@]}" --nproc_per_node "$NPROC_PER_NODE" \
  -m vlmfast.cli.main train "${args[@]}"
