"""Memory you can plan (docs/memory.md): each rank's peak predicted before a run, measured on
the CPU, refused before it runs out, named when it happens anyway.

- `predict_memory(spec, config, world_size, ...)`: the plan `zeroshard explain` prints (plan.py).
- `predict_step(spec, config, world_size, ...)`: one training step traced on fake tensors with
  the engine's buffers replayed around it (trace.py, replay.py): the peak per rank and its parts.
- `preset_spec`, `hf_config_spec`, `factory_spec`: the models it can build (specs.py).
- `AllocationTracker`: what torch really allocates on the CPU, by phase (tracker.py).
"""

from zeroshard.memory.plan import MemoryPlan, predict_memory
from zeroshard.memory.specs import factory_spec, hf_config_spec, preset_spec
from zeroshard.memory.trace import ModelSpec, StepTrace
from zeroshard.memory.trace import trace_step as predict_step
from zeroshard.memory.tracker import AllocationTracker, PhasePeak, enable_cpu_memory_reporting

__all__ = [
    "AllocationTracker",
    "MemoryPlan",
    "ModelSpec",
    "PhasePeak",
    "StepTrace",
    "enable_cpu_memory_reporting",
    "factory_spec",
    "hf_config_spec",
    "predict_memory",
    "predict_step",
    "preset_spec",
]
