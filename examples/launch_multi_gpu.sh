#!/usr/bin/env bash
# Train the built-in tiny VLM on every GPU of this machine (or 2 CPU processes with gloo when there is none).
# Usage: bash examples/launch_multi_gpu.sh [extra vlmfast train arguments]
set -euo pipefail
gpus=$(python -c "import torch; print(torch.cuda.device_count() or 2)")
exec torchrun --standalone --nproc_per_node "$gpus" -m vlmfast.cli train --set batch_size=8 "$@"
