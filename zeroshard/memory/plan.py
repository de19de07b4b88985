"""A rank's memory plan: the peak of a training step and its parts, the expected reserved memory,
the host's peak, and the host peaks of saving, consolidating and loading a checkpoint.

`predict_memory` is what `zeroshard explain` prints and what `initialize` checks against the
budget (budget.py). Everything is per rank, in bytes; where ranks differ (Muon's owners) the
largest rank's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zeroshard.config.schema import ZeroshardConfig
from zeroshard.memory.checkpoint_peaks import checkpoint_host_peaks
from zeroshard.memory.exchange import exchange_buffer_bytes
from zeroshard.memory.ledger import HOST
from zeroshard.memory.trace import ModelSpec, StepTrace, trace_step

__all__ = ["RESERVED_RATIO", "MemoryPlan", "predict_memory"]

# CUDA's caching allocator reserves more than it hands out (block rounding, fragmentation). The
# one measured run (docs/benchmarks.md, H100, the 1b preset, bf16): reserved / allocated peak
# 1.126, 1.166, 1.139, 1.121 at stages 0-3, median 1.13. An estimate from one run, said so.
RESERVED_RATIO = 1.13

PART_ORDER = (
    "params", "gradients", "master_weights", "optimizer_state", "activations", "gathered_units", "gather_buffers",
    "reduce_buckets", "publish_buckets", "optimizer_step", "expert_exchange", "sequence_exchange", "buffers",
    "inputs",
)


@dataclass
class MemoryPlan:
    """Predicted bytes on one rank (docs/memory.md has each field's meaning)."""

    world_size: int
    device: str
    micro_batch: int
    seq: int | None
    activation_checkpointing: bool
    device_peak_bytes: int
    peak_phase: str
    parts: dict[str, int]
    reserved_bytes: int | None
    host_peak_bytes: int
    host_parts: dict[str, int]
    phase_peaks: dict[str, int]
    activations: dict[str, int]
    checkpoint: dict[str, int]
    traced: bool
    assumptions: list[str] = field(default_factory=list)

    @property
    def save_host_peak_bytes(self) -> int:
        return self.checkpoint["save"]

    def largest_parts(self, n: int = 3) -> list[tuple[str, int]]:
        return sorted(((k, v) for k, v in self.parts.items() if v), key=lambda kv: -kv[1])[:n]

    def as_dict(self) -> dict[str, Any]:
        return {
            "device_peak_bytes": self.device_peak_bytes,
            "host_peak_bytes": self.host_peak_bytes,
            "reserved_bytes": self.reserved_bytes,
            "save_host_peak_bytes": self.checkpoint["save"],
            "async_save_host_peak_bytes": self.checkpoint["async_save"],
            "consolidate_fp32_host_peak_bytes": self.checkpoint["consolidate_fp32"],
            "consolidate_16bit_host_peak_bytes": self.checkpoint["consolidate_16bit"],
            "load_host_peak_bytes": self.checkpoint["load"],
            "peak_phase": self.peak_phase,
            "parts": dict(self.parts),
            "host_parts": dict(self.host_parts),
            "phase_peaks": dict(self.phase_peaks),
            "activations": dict(self.activations),
            "micro_batch": self.micro_batch,
            "seq": self.seq,
            "activation_checkpointing": self.activation_checkpointing,
            "device": self.device,
            "traced": self.traced,
            "assumptions": list(self.assumptions),
        }


def _ordered(parts: dict[str, int]) -> dict[str, int]:
    known = {k: parts.get(k, 0) for k in PART_ORDER}
    known.update({k: v for k, v in parts.items() if k not in known})
    return known


def predict_memory(
    spec: ModelSpec,
    config: ZeroshardConfig,
    world_size: int,
    *,
    micro_batch: int | None = None,
    seq: int | None = None,
    activation_checkpointing: bool = False,
    device_type: str = "cuda",
) -> MemoryPlan:
    """Predict one rank's memory for training `spec` under `config` on `world_size` ranks.

    Args:
        spec: the model and its inputs (specs.py: a preset, a Hugging Face config, a factory).
        config: the resolved config (stage, precision, offload, optimizer, bucket sizes).
        world_size: ranks.
        micro_batch: samples per micro-step (default: the config's).
        seq: tokens per sample (default: the model's longest).
        activation_checkpointing: each unit recomputes its activations in backward.
        device_type: "cuda" (an accelerator: device and host apart) or "cpu" (one memory: the
            device peak counts the host-placed states too).
    """
    micro_batch = micro_batch or config.train_micro_batch_size_per_gpu or 1
    seq = seq or spec.max_seq
    if spec.max_seq is not None and seq is not None and seq > spec.max_seq:
        raise ValueError(f"--seq {seq}: the model takes at most {spec.max_seq} tokens per sample.")
    trace: StepTrace = trace_step(spec, config, world_size, micro_batch=micro_batch, seq=seq,
                                  activation_checkpointing=activation_checkpointing, device_type=device_type)
    exchange = exchange_buffer_bytes(trace.units[0].module, config, micro_batch, seq)
    on_cpu = device_type == "cpu"
    peak = trace.combined if on_cpu else trace.device
    parts: dict[str, int] = {}
    for key, value in peak.parts.items():  # on the CPU a host-placed state is one more device part
        parts[key.removeprefix(HOST)] = parts.get(key.removeprefix(HOST), 0) + value
    parts.update(exchange)
    device_peak = peak.bytes + sum(exchange.values())
    assumptions = []
    if not trace.traced:
        assumptions.append(f"{spec.name}: its inputs are unknown, so no forward was traced: activations are not "
                           "included (use a preset or --hf-config)")
    if getattr(config.precision_plan, "fp8", None):
        assumptions.append("fp8 compute (zeroshard.fp8): the trace runs the Linear layers in the parameter dtype and "
                           "gathers in it, so their activations and stage-3 gathers are overestimated")
    if getattr(getattr(config, "zeroshard", None), "deterministic_reduction", False):
        assumptions.append("deterministic reduction (zeroshard.deterministic_reduction): its all-to-all buckets and "
                           "ordered row sums are not replayed, so this is the default reduction's peak; a simulated "
                           "stage-2 rank of 64 measured 32% above it (docs/deterministic-reduction.md)")
    if any(exchange.values()):
        assumptions.append("expert and sequence exchange buffers: counted from their sizes, not traced "
                           "(not checked against a measurement)")
    if not on_cpu:
        assumptions.append(f"reserved: {RESERVED_RATIO} x the allocated peak, the median of one H100 run "
                           "(docs/benchmarks.md); not measured on this model")
        assumptions.append("activations traced with the CPU's kernels and autocast policy (flash attention on both)")
    return MemoryPlan(
        world_size=world_size, device=device_type, micro_batch=micro_batch, seq=seq,
        activation_checkpointing=activation_checkpointing, device_peak_bytes=device_peak, peak_phase=peak.phase,
        parts=_ordered(parts), reserved_bytes=None if on_cpu else int(device_peak * RESERVED_RATIO),
        host_peak_bytes=trace.host.bytes, host_parts={k.removeprefix(HOST): v for k, v in trace.host.parts.items()},
        phase_peaks=trace.phase_peaks, activations=trace.activations,
        checkpoint=checkpoint_host_peaks(trace.units, config, device_type), traced=trace.traced,
        assumptions=assumptions,
    )
