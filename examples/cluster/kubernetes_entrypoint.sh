#!/usr/bin/env bash
# Kubernetes / Kubeflow PyTorchJob: the container's command (docs/cluster.md, kubernetes.yaml).
# Plain torchrun, configured from the environment the operator sets (PET_NNODES,
# PET_NPROC_PER_NODE, PET_NODE_RANK, MASTER_ADDR, MASTER_PORT); nothing else.
#
# The kubelet sends SIGTERM to the container's processes on eviction or preemption: the workers
# save together and exit 143, which Kubeflow's `restartPolicy: ExitCode` treats as retryable
# (128-255) and `OnFailure` restarts too. PROGRESS_FILE (on the shared volume) records each
# attempt: its exit status and the checkpoint `latest` names, for whoever watches the job.
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CONFIG="${CONFIG:-$HERE/../configs/zero2_fp32.json}"
SAVE_DIR="${SAVE_DIR:?set SAVE_DIR to a directory on the shared volume}"
PROGRESS_FILE="${PROGRESS_FILE:-$SAVE_DIR/progress.jsonl}"

before="$(cat "$SAVE_DIR/latest" 2>/dev/null || echo none)"
python -m torch.distributed.run \
    --nnodes="${PET_NNODES:-1}" \
    --nproc_per_node="${PET_NPROC_PER_NODE:-1}" \
    --node_rank="${PET_NODE_RANK:-0}" \
    --master_addr="${MASTER_ADDR:-127.0.0.1}" \
    --master_port="${MASTER_PORT:-29500}" \
    "$HERE/../train_preemptible.py" --deepspeed_config "$CONFIG" --save-dir "$SAVE_DIR" "$@" &
child=$!
# Bash runs a trap only between commands: torchrun runs in the background, and the kubelet's
# SIGTERM is passed on to it (torchrun sends it on to its workers).
trap 'kill -TERM "$child" 2>/dev/null' TERM
while true; do
    wait "$child"; status=$?
    kill -0 "$child" 2>/dev/null || break  # wait returned early for the trap: wait again
done
latest="$(cat "$SAVE_DIR/latest" 2>/dev/null || echo none)"
# torchrun exits 1 whatever status its workers had. A failed attempt that saved a checkpoint
# (the workers' preemption save: they exit 143) is reported as 143, retryable to Kubeflow.
if [ "$status" -ne 0 ] && [ "$latest" != "$before" ]; then status=143; fi
mkdir -p "$(dirname "$PROGRESS_FILE")"
printf '{"time": "%s", "exit_code": %d, "latest": "%s"}\n' "$(date -u +%FT%TZ)" "$status" "$latest" >> "$PROGRESS_FILE"
exit "$status"
