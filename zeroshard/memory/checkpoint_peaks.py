"""The host memory a checkpoint operation takes on one rank, beyond what training holds.

They follow what zeroshard/checkpoint/ does (docs/memory.md, "Checkpoints in bounded host
memory"): a synchronous save streams its rank file tensor by tensor (on an accelerator each
tensor is copied to the host just before it is written; on the CPU it is written where it
lies); an asynchronous save keeps a host copy of the rank's whole share, so training can go on
(its purpose); consolidating (`zeroshard to-fp32`, DeepSpeed's converters) builds one parameter
at a time from its saved fragments and streams it into the output file; a 16-bit export gathers
one unit at a time and rank 0 streams it; a load reads and installs one flat at a time.
"""

from __future__ import annotations

from zeroshard.config.schema import ZeroshardConfig
from zeroshard.memory.layout import UnitShape

__all__ = ["checkpoint_host_peaks"]


def checkpoint_host_peaks(units: list[UnitShape], config: ZeroshardConfig, device_type: str = "cuda") -> dict[str, int]:
    """{save, async_save, consolidate_fp32, consolidate_16bit, load}: host bytes at the peak of each."""
    states_per_element = {"adamw": 2, "adam": 2, "muon": 1, "sgd": 1}
    kind = (config.optimizer.type.lower() if config.optimizer else "adamw")
    flats = [f for u in units for f in u.flats]
    share, largest_flat, largest_tensor = 0, 0, 0
    for flat in flats:
        role = flat.role
        count = states_per_element.get(kind, 2) if not flat.use_muon else 1
        master = flat.master_numel * role.master_dtype.itemsize
        state = flat.master_numel * role.optimizer_state_dtype.itemsize
        flat_bytes = master + count * state
        share += flat_bytes
        largest_flat = max(largest_flat, flat_bytes)
        largest_tensor = max(largest_tensor, master, state)
    on_host = device_type == "cpu" or config.zero_optimization.optimizer_offload
    largest_param = max((n for f in flats for n in f.numels), default=0)
    # On the CPU a stage-3 unit gathered for the export is host memory too; on an accelerator
    # only the tensor on its way to the file is.
    gathered = device_type == "cpu" and any(f.params_sharded for f in flats)
    largest_unit = max((sum(f.padded_numel * f.role.param_dtype.itemsize for f in u.flats) for u in units),
                       default=0) if gathered else 0
    param_itemsize = max((f.role.param_dtype.itemsize for f in flats), default=4)
    return {
        "save": 0 if on_host else largest_tensor,
        "async_save": share,
        # the parameter in fp32, and its fragments as saved (the master dtype) while it is built
        "consolidate_fp32": largest_param * (4 + max((f.role.master_dtype.itemsize for f in flats), default=4)),
        "consolidate_16bit": largest_unit + largest_param * param_itemsize,
        "load": largest_flat,
    }
