#!/usr/bin/env bash
# torchrun elastic: a preempted (or lost) worker group is restarted and resumes (docs/cluster.md).
#
#   NPROC=2 examples/cluster/torchrun_elastic.sh --save-dir ckpt --steps 200
#
# On every node of a multi-node job, with the same rendezvous endpoint:
#   NNODES=2:4 NPROC=8 RDZV_ENDPOINT=node01:29400 examples/cluster/torchrun_elastic.sh ...
#
# A SIGTERM/SIGUSR1/SIGUSR2 to any worker: every worker saves the same checkpoint and exits 143;
# torchrun counts that as a failure and restarts the group (while --max-restarts lasts), with
# the nodes then present (--nnodes MIN:MAX); the new workers resume from that checkpoint at
# their world size (preemption.resume, set by train_preemptible.py).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CONFIG="${CONFIG:-$HERE/../configs/zero2_fp32.json}"
# torch >= 2.5 lets the workers share the c10d rendezvous store, without a prefix per restart:
# a restarted group then reads the previous group's addresses and fails to connect ("Gloo
# connectFullMesh failed ... Connection refused"; NCCL the same way: pytorch/pytorch#135712,
# #167288). A store of their own per restart avoids it.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"
exec python -m torch.distributed.run \
    --nnodes="${NNODES:-1}" \
    --nproc_per_node="${NPROC:-2}" \
    --max-restarts="${MAX_RESTARTS:-3}" \
    --rdzv-backend=c10d \
    --rdzv-endpoint="${RDZV_ENDPOINT:-127.0.0.1:0}" \
    --rdzv-id="${RDZV_ID:-zeroshard-job}" \
    "$HERE/../train_preemptible.py" --deepspeed_config "$CONFIG" "$@"
