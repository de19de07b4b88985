#!/usr/bin/env bash
# Downloads, into .whl/ at the repository root (git-ignored through .git/info/exclude), the
# wheels of zeroshard's dependencies that the GPU machine lacks (it has no network): pydantic
# and its own dependencies, hjson, and torchao (zeroshard[fp8]: the check's fp8 rows). scripts/gpu_check.sh
# installs them from there.
#
# Versions: pydantic 2.14.4 satisfies pyproject's "pydantic>=2.5,<3" and pins pydantic-core
# 2.50.5 in its METADATA; both need typing-extensions>=4.16 (newer than what torch's images
# usually carry), so it comes too. torchao 0.18.0 (pyproject's pin) is ABI-stable against torch >= 2.11, the
# GPU machine's torch 2.11 included; its wheel is abi3 (CPython >= 3.10). All for CPython 3.12 on
# x86-64 Linux (the GPU machine).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
exclude="$(git rev-parse --git-common-dir)/info/exclude"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo /.whl/ >> "$exclude"
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl pydantic==2.14.4 pydantic-core==2.50.5 "annotated-types>=0.6.0" "typing-inspection>=0.4.4" \
    "typing-extensions>=4.16.0" "hjson>=3.0" torchao==0.18.0
ls -l .whl
