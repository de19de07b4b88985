"""Sharded checkpoints (docs/design.md section 6): the public functions behind the engine's methods.

- `save_checkpoint(engine, save_dir, tag, client_state, save_latest)`: every rank writes its
  shards of the master weights and optimizer state (safetensors), rank 0 one JSON index
  mapping each parameter name to its fragments, plus counters, loss-scaler, scheduler and
  sampler state, per-rank RNG state, the config, the precision plan and `client_state`.
  Atomic: written to a temporary directory, then renamed; `latest` names the last
  complete tag.
- asynchronous saves (`checkpoint.writer.decoupled`, or `async_save=True`): the state is
  copied to host memory and a background thread writes the files
  ([Note: asynchronous saves] in async_save.py); `wait_for_checkpoint()` waits for it.
- `load_checkpoint(engine, load_dir, tag, ...)`: loads onto any world size and stage by
  reading the saved fragments that overlap each new shard; validates everything before it
  changes anything.
- `consolidate_fp32(ckpt_dir, tag)` / `write_fp32(...)`: the full fp32 state dict
  (`zeroshard to-fp32`).
- `save_16bit_model(engine, save_dir, save_filename)`: consolidated weights in the
  parameter dtype, for inference.

The format is described in [Note: checkpoint layout] (format.py) and
docs/checkpoints.md.
"""

from __future__ import annotations

from zeroshard.checkpoint.async_save import wait_for_checkpoint
from zeroshard.checkpoint.export import consolidate_fp32, save_16bit_model, write_fp32
from zeroshard.checkpoint.format import CheckpointError
from zeroshard.checkpoint.load import load_checkpoint
from zeroshard.checkpoint.save import save_checkpoint

__all__ = [
    "CheckpointError",
    "consolidate_fp32",
    "load_checkpoint",
    "save_16bit_model",
    "save_checkpoint",
    "wait_for_checkpoint",
    "write_fp32",
]
