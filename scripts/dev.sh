#!/usr/bin/env bash
# Set up a virtual environment in .venv (once) and run the demo or the test suite.
#
#   bash scripts/dev.sh demo [demo options]    # zeroshard demo
#   bash scripts/dev.sh test [pytest options]  # python -m pytest -q
#
# On a machine without a GPU (no nvidia-smi) and without torch in .venv, the CPU build
# torch==2.13.0 is installed first. With a GPU, install your CUDA build of torch into .venv
# before running this, or pip resolves `torch>=2.4` from PyPI.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

command="${1:-}"
case "$command" in
  demo | test) shift ;;
  *)
    echo "usage: bash scripts/dev.sh {demo|test} [args...]" >&2
    exit 2
    ;;
esac

python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "creating .venv with $("$python" --version 2>&1)"
  "$python" -m venv .venv
fi
venv_python=.venv/bin/python

if ! "$venv_python" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    echo "nvidia-smi found and no torch in .venv: pip will pick torch from PyPI (a CUDA build)."
  else
    echo "installing the CPU build torch==2.13.0"
    "$venv_python" -m pip install --quiet "torch==2.13.0"
  fi
fi

"$venv_python" -m pip install --quiet -e ".[dev]"

if [ "$command" = demo ]; then
  exec .venv/bin/zeroshard demo "$@"
else
  exec "$venv_python" -m pytest -q "$@"
fi
