"""The GPU check (issue 25): zeroshard's correctness and speed checks on one device, each a row.

Run it through scripts/gpu_check.sh (which installs missing dependencies from .whl/ first):

    bash scripts/gpu_check.sh OUTDIR [--device cuda|cpu] [--quick]

Rows: the conformance matrix (runner-side `conformance`), host synchronisations in steady-state
steps (`sync_debug`), Newton-Schulz, offload and MoE on the device (`numerics`), the optional
expert-path benchmark and the model benchmark (`model_bench`). Every row is written to
OUTDIR/gpu_check.json as soon as it ends, so a run cut short still leaves what it measured.
"""
