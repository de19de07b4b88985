#!/usr/bin/env bash
# zeroshard's GPU check (issue 25): conformance, host syncs, Newton-Schulz, offload, MoE, the
# model benchmark and the predicted memory peak (issue 39) on one device, one row each; results
# in OUTDIR/gpu_check.json (rewritten after every row) and OUTDIR/gpu_check.txt (the table,
# printed last). See docs/benchmarks.md.
#
#   bash scripts/gpu_check.sh OUTDIR [--device cuda|cpu] [--quick] [--simulated] [--only PREFIXES]
#   bash scripts/gpu_check.sh OUTDIR [--device cuda|cpu] --nproc N     # world N: one process per GPU
#
# --nproc N (N > 1) runs benchmarks/gpu_check/multi.py under torchrun: the conformance matrix at
# world N (NCCL; gloo with --device cpu) and the model benchmark (zeroshard stages 0-3, DDP, FSDP2;
# tokens/s per GPU, peak memory, exposed communication). --simulated adds the simulated scaling
# rows (h/: zeroshard simulate, benchmarks/simulate_scale.py's grid) to the one-device check.
#
# With a .whl/ folder in the repository root (scripts/gpu_wheels.sh fills it), its wheels are
# installed first with no network into $GPU_CHECK_SITE (default /tmp/site), put ahead on
# PYTHONPATH: the GPU machine lacks pydantic and hjson. GPU_CHECK_NO_WHEELS=1 skips that.
# PYTHON picks the interpreter (default python3). Exit status: 0 when no row failed.
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
if [ $# -lt 1 ]; then
    echo "usage: bash scripts/gpu_check.sh OUTDIR [--device cuda|cpu] [--quick] [--simulated] [--nproc N]" >&2
    exit 2
fi
OUT=$1
shift
PY=${PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/site}
EXTRA=""
if [ -z "${GPU_CHECK_NO_WHEELS:-}" ] && ls "$REPO"/.whl/*.whl >/dev/null 2>&1; then
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$REPO"/.whl/*.whl; then
        EXTRA="$SITE:"
    else
        echo "gpu_check.sh: installing .whl/ failed; going on without it" >&2
    fi
fi
export PYTHONPATH="${EXTRA}${REPO}${PYTHONPATH:+:$PYTHONPATH}"
cd "$REPO"
NPROC=1
ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --nproc) NPROC=${2:?--nproc needs a number}; shift 2 ;;
        --nproc=*) NPROC=${1#--nproc=}; shift ;;
        *) ARGS+=("$1"); shift ;;
    esac
done
if ! [ "$NPROC" -ge 1 ] 2>/dev/null; then
    echo "gpu_check.sh: --nproc $NPROC: a positive number of processes" >&2
    exit 2
fi
if [ "$NPROC" -gt 1 ]; then
    exec "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" -m benchmarks.gpu_check.multi "$OUT" \
        ${ARGS[@]+"${ARGS[@]}"}
fi
exec "$PY" -m benchmarks.gpu_check "$OUT" ${ARGS[@]+"${ARGS[@]}"}
