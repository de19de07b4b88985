"""What the peer benchmark measures besides time: memory and communication.

Memory has three figures per rank:

* `model_state_bytes` by role (params, gradients, master weights, optimizer state): the bytes
  of the tensors an engine holds for those roles between the end of a backward and the
  optimizer step (every role is alive there), each storage counted once (a master that is a
  view of the parameters costs nothing extra). Exact for zeroshard (its flat buffers) and for
  torch peers (parameters, `.grad` and `optimizer.state`); for DeepSpeed the module
  parameters, the optimizer's parameters (masters) and state, and under `buffers` every other
  tensor its ZeRO optimizer holds (flat partitions, reduce buckets).
* `live_tensor_bytes`: every tensor storage alive in the process at the same moment (found
  through the garbage collector), each counted once: a cross-check that no engine hides
  buffers outside the roles above.
* `peak_rss_bytes`: the process's resident-set high-water mark (`getrusage`), and
  `baseline_rss_bytes`, the resident set before the model was built (torch and the engine's
  imports), so that the difference is what training cost.

Communication is in the zeroshard recorder's unit: for each collective, the bytes of the full
(unsharded) buffer, summed per step. A ring sends (W-1)/W of that per rank for an all-gather or a
reduce-scatter and 2(W-1)/W for an all-reduce; `wire_bytes_per_rank` applies those factors.
zeroshard's figure is recorded; the peers' is the theory of their algorithm (`peer_comm_theory`).
"""

from __future__ import annotations

import gc
import resource
import warnings
from collections.abc import Iterable

import torch

ROLES = ("params", "gradients", "master_weights", "optimizer_state")
# Tensors an engine holds beyond the four roles (DeepSpeed's flat partitions and buckets).
OTHER = "buffers"


def _storage_key_and_bytes(t: torch.Tensor) -> tuple[int, int] | None:
    local = t.to_local() if hasattr(t, "to_local") else t  # DTensor: this rank's piece
    if local.device.type == "meta":
        return None
    storage = local.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


class StorageCounter:
    """Sums storage bytes per role, each storage once (the first role that claims it keeps it)."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.by_role: dict[str, int] = dict.fromkeys((*ROLES, OTHER), 0)

    def add(self, role: str, tensors: Iterable[torch.Tensor | None]) -> None:
        for t in tensors:
            if t is None or not isinstance(t, torch.Tensor):
                continue
            found = _storage_key_and_bytes(t)
            if found is None:
                continue
            ptr, nbytes = found
            if nbytes == 0 or ptr in self.seen:
                continue
            self.seen.add(ptr)
            self.by_role[role] += nbytes

    @property
    def total(self) -> int:
        """Model-state bytes: the four roles, without the `buffers` beyond them."""
        return sum(self.by_role[r] for r in ROLES)


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor in `optimizer.state` (AdamW: exp_avg, exp_avg_sq; the scalar step too)."""
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage reachable by the garbage collector."""
    seen: set[int] = set()
    total = 0
    with warnings.catch_warnings():
        # isinstance() on deprecated module proxies (torch.distributed.reduce_op) warns.
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in tensors:
        try:
            found = _storage_key_and_bytes(obj)
        except Exception:  # noqa: BLE001 - exotic tensor subclasses without storage
            continue
        if found is None or found[0] in seen:
            continue
        seen.add(found[0])
        total += found[1]
    return total


def current_rss_bytes() -> int:
    """The resident set now (Linux /proc)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def peak_rss_bytes() -> int:
    """The resident-set high-water mark of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ------------------------------------------------------------------------------------------
# Communication
# ------------------------------------------------------------------------------------------

_RING_FACTOR = {"all_reduce": 2.0, "reduce_scatter": 1.0, "all_gather": 1.0, "broadcast": 1.0}


def wire_bytes_per_rank(buffer_bytes_by_op: dict[str, float], world_size: int) -> float:
    """Bytes one rank sends per step with ring algorithms, from buffer bytes per op."""
    if world_size <= 1:
        return 0.0
    share = (world_size - 1) / world_size
    return sum(_RING_FACTOR.get(op, 1.0) * share * b for op, b in buffer_bytes_by_op.items())


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def peer_comm_theory(
    engine: str, mode: str, stage: int | None, reshard: bool | None, numel_root: int, numel_blocks: int
) -> tuple[dict[str, float], str]:
    """Theoretical buffer bytes per step by op for a peer, and how it was derived.

    Args:
        engine: "ddp", "fsdp2" or "deepspeed".
        mode: the precision mode (see peers_workload).
        stage: DeepSpeed's ZeRO stage.
        reshard: FSDP2's reshard_after_forward.
        numel_root: parameters outside the repeated blocks (embeddings, final LayerNorm).
        numel_blocks: parameters of all blocks together.
    """
    p = numel_root + numel_blocks
    low = torch.bfloat16 if mode in ("bf16", "autocast") else torch.float16
    if engine == "ddp":
        grad_dtype = torch.bfloat16 if mode == "bf16" else torch.float32
        return {"all_reduce": p * _size(grad_dtype)}, (
            f"one all-reduce of every gradient in the parameter dtype ({grad_dtype})"
        )
    if engine == "fsdp2":
        gather = _size(low) if mode == "bf16" else 4
        # FSDP2 never reshards the root after forward; blocks are gathered again for backward
        # only when reshard_after_forward is True.
        gathered = p + (numel_blocks if reshard else 0)
        return (
            {"all_gather": gathered * gather, "reduce_scatter": p * 4, "all_reduce": 4},
            "all-gather per block in forward"
            + (" and again in backward" if reshard else "")
            + " (param dtype), one reduce-scatter of gradients in fp32, the clip norm all-reduce",
        )
    if engine == "deepspeed":
        param = _size(low) if mode in ("bf16", "fp16") else 4
        # DeepSpeed 0.19 reduces in the parameter dtype unless communication_data_type says so.
        reduce = param if mode != "autocast" else _size(low)
        if stage == 0:
            return {"all_reduce": p * reduce}, "all-reduce of every gradient"
        if stage in (1, 2):
            return (
                {"reduce_scatter": p * reduce, "all_gather": p * param},
                "reduce(-scatter) of gradients, all-gather of updated parameters",
            )
        return (
            {"all_gather": 2 * p * param, "reduce_scatter": p * reduce},
            "all-gather in forward and in backward, reduce-scatter of gradients",
        )
    raise ValueError(f"no communication theory for engine {engine!r}")


def zeroshard_comm_theory(engine) -> dict[str, float]:
    """What zeroshard should send per step (no accumulation), from its flat buffers' dtypes.

    Stages 0-1 all-reduce every padded flat buffer in the reduce dtype; stages 2-3
    reduce-scatter it; stages 1-2 all-gather the updated parameters in the parameter dtype; stage 3 all-gathers
    every non-resident flat in the gather dtype before its forward and again before its
    backward, while resident units (below stage3_param_persistence_threshold) are all-gathered
    after the step as at stages 1-2. Plus the
    4-byte all-reduce of the gradient norm.
    """
    stage = engine.policy.stage
    out: dict[str, float] = {"all_reduce": 4.0}
    for flat in engine.flats:
        reduce = flat.padded_numel * _size(flat.role.reduce_dtype)
        if stage == 0:
            out["all_reduce"] += reduce
            continue
        if stage == 1:
            out["all_reduce"] += reduce
        else:
            out["reduce_scatter"] = out.get("reduce_scatter", 0.0) + reduce
        if flat.policy.keep_full_params:  # stages 1-2, and stage-3 units kept resident
            gather_after_step = flat.padded_numel * _size(flat.role.param_dtype)
            out["all_gather"] = out.get("all_gather", 0.0) + gather_after_step
            continue
        out["all_gather"] = out.get("all_gather", 0.0) + 2 * flat.padded_numel * _size(flat.role.gather_dtype)
    return out
