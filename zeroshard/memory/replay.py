"""What the engine allocates around the model's forward and backward, replayed on fake tensors.

[Note: the engine's allocations, replayed]
The prediction runs the model's own forward and backward on fake tensors (ledger.py) and, from
hooks on the same modules and parameters, allocates what the engine would, when it would, in
the same sizes and dtypes, so each buffer's lifetime overlaps the activations exactly as in a
real step. Each line below names the engine code it follows; a change there that moves memory
shows up as a miss in tests/dist/memory/test_peak_grid.py and benchmarks/memory_peak.py.

* model states (allocated once, before the measured step): full flats (stages 0-2 and
  resident stage-3 units), stage 3's parameter shards (none where the gather casts the master),
  masters that are copies of their own, on the host with offload (sharding/flat.py
  `_make_master`); the optimizer's state comes from running the real optimizer once.
* stage 3 (sharding/schedule.py): a unit's full flat is allocated by its gather (the unit's
  forward, and again when the gradient reaches its outputs in backward), the next unit(s) in
  forward order are prefetched within `stage3_prefetch_bucket_size` (backward: the previous),
  with the gather's own buffers (sharding/gather.py: the source copy, or the wire buffers when the
  wire dtype differs) alive until the gather completes; freed after the unit's forward and once
  its gradient is queued for reduction; the root unit stays gathered through the forward.
* gradients (grads/buffers.py, grads/path.py): the autograd gradient lives until its hook has
  copied it into the flat's local buffer (allocated at the first gradient); units are queued for
  reduction in reverse order as they complete; on the CPU the buffers of stages 0-1 (local) and
  2-3 (reduced shard) are kept between steps, on an accelerator they are allocated in the
  backward and freed after the step ([Note: released between steps on an accelerator]).
* reduction (grads/reduce.py): buckets of `reduce_bucket_size` elements in the wire dtype, sized
  to what remains to be reduced, filled across units, at most one in flight while the next
  fills; a flat that alone fills a bucket is reduced from its own buffer; a reduce-scatter's
  output; the result is written into the reduced shard (offload: landed on the host, cast to the
  master dtype, sharding/offload.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zeroshard.memory.layout import FlatShape, UnitShape
from zeroshard.memory.ledger import HOST, Ledger

__all__ = ["EngineReplay", "ReplayFlat", "Terms"]


class Terms:
    """The labels of the prediction's parts (docs/memory.md lists them)."""

    PARAMS = "params"
    GRADIENTS = "gradients"
    MASTERS = "master_weights"
    OPTIMIZER_STATE = "optimizer_state"
    BUFFERS = "buffers"  # the module's buffers and frozen parameters
    GATHERED = "gathered_units"
    GATHER_WIRE = "gather_buffers"
    REDUCE_BUCKETS = "reduce_buckets"
    STEP = "optimizer_step"
    PUBLISH = "publish_buckets"
    HOST_MASTERS = HOST + "master_weights"
    HOST_OPTIMIZER_STATE = HOST + "optimizer_state"
    HOST_PARAMS = HOST + "params"
    HOST_GRADS = HOST + "gradient_landing"
    HOST_STEP = HOST + "optimizer_step"


@dataclass
class ReplayFlat:
    """A flat's buffers as fake tensors (the attributes ShardedMuon reads from a flat too)."""

    shape: FlatShape
    device: torch.device
    full: torch.Tensor | None = None
    param_shard: torch.Tensor | None = None
    master: torch.Tensor | None = None
    local: torch.Tensor | None = None
    reduced: torch.Tensor | None = None
    reduced_full: torch.Tensor | None = None
    landing: torch.Tensor | None = None

    # ShardedMuon's view of a flat (optim/muon/sharded.py): names, params, shapes, offsets,
    # the shard group's size and this rank's place in it, the master's range.
    def __getattr__(self, name: str) -> Any:
        if name in ("names", "params", "shapes", "offsets", "shard_size", "shard_rank", "padded_numel",
                    "shard_numel", "numel", "master_range"):
            return getattr(self.shape, name)
        raise AttributeError(name)

    @property
    def spec(self) -> Any:
        return None

    def shard_of(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.narrow(0, self.shape.shard_start, self.shape.shard_numel)

    def master_part(self, full: torch.Tensor) -> torch.Tensor:
        return self.shard_of(full) if self.shape.policy.shard_optimizer else full


class _Reducer:
    """grads/reduce.py's GradientReducer, by sizes (the note above)."""

    def __init__(self, replay: EngineReplay, flats: list[ReplayFlat], bucket_numel: int) -> None:
        self.replay = replay
        self.bucket_numel = max(1, bucket_numel)
        self.total: dict[tuple, int] = {}
        for flat in flats:
            key = self._key(flat)
            self.total[key] = self.total.get(key, 0) + flat.shape.shard_numel
        self.added: dict[tuple, int] = {}
        self.open: dict[tuple, dict[str, Any]] = {}
        self.issued: list[dict[str, Any]] = []

    @staticmethod
    def _key(flat: ReplayFlat) -> tuple:
        role = flat.shape.role
        return flat.shape.policy.scatter, role.grad_accum_dtype, role.reduce_dtype

    def add(self, flat: ReplayFlat) -> None:
        shape = flat.shape
        key, rows, cols = self._key(flat), shape.shard_size, shape.shard_numel
        acc, wire = shape.role.grad_accum_dtype, shape.role.reduce_dtype
        local = self.replay.local_buffer(flat)
        in_place = flat.reduced is None and not shape.policy.reduce_every_backward
        if in_place:
            flat.reduced_full, flat.reduced, flat.local = local, flat.master_part(local), None
        torch.sum(local, dtype=torch.float32)  # _note_local
        safe = in_place or shape.policy.reduce_every_backward
        if safe and wire == acc and key not in self.open and shape.padded_numel >= self.bucket_numel:
            self.open[key] = {"staging": local.view(rows, cols), "pieces": [(flat, 0, cols, 0, in_place)], "used": cols}
            self.added[key] = self.added.get(key, 0) + cols
            self._issue(key)
            if not in_place:
                flat.local = None
            return
        c0 = 0
        while c0 < cols:
            bucket = self.open.get(key)
            if bucket is None:
                remaining = self.total[key] - self.added.get(key, 0)
                capacity = min(max(1, self.bucket_numel // rows), max(1, remaining))
                with self.replay.ledger.label(Terms.REDUCE_BUCKETS):
                    staging = torch.empty(rows, capacity, dtype=wire, device=local.device)
                bucket = self.open[key] = {"staging": staging, "pieces": [], "used": 0}
            n = min(bucket["staging"].shape[1] - bucket["used"], cols - c0)
            bucket["pieces"].append((flat, c0, c0 + n, bucket["used"], in_place))
            bucket["used"] += n
            self.added[key] = self.added.get(key, 0) + n
            c0 += n
            if bucket["used"] == bucket["staging"].shape[1]:
                self._issue(key)
        if not in_place and shape.policy.reduce_every_backward:
            flat.local = None  # stages 2-3 free it (end_reduction); stages 0-1 keep it for the next

    def _issue(self, key: tuple) -> None:
        self.complete()
        bucket = self.open.pop(key)
        data = bucket["staging"][:, : bucket["used"]]
        with self.replay.ledger.label(Terms.REDUCE_BUCKETS):
            if bucket["used"] < bucket["staging"].shape[1]:
                data = data.contiguous()
            bucket["data"] = data
            bucket["out"] = torch.empty(bucket["used"], dtype=data.dtype, device=data.device) if key[0] else None
        self.issued.append(bucket)

    def complete(self) -> None:
        issued, self.issued = self.issued, []
        for bucket in issued:
            result = bucket["out"].view(1, -1) if bucket["out"] is not None else bucket["data"]
            for flat, c0, c1, offset, in_place in bucket["pieces"]:
                piece = result[:, offset : offset + c1 - c0]
                if flat.shape.policy.scatter:
                    target = self.replay.reduced_buffer(flat)[c0:c1]
                    target.add_(piece[0])
                elif not in_place:
                    self.replay.reduced_buffer(flat)
                self.replay.land(flat, c0, c1)

    def finish(self) -> None:
        for key in list(self.open):
            self._issue(key)
        self.complete()
        self.added.clear()


class EngineReplay:
    """The engine's buffers around one fake model (the note above).

    Args:
        ledger: where the fake tensors are counted.
        units: the layout (layout.py), root first; their modules are the fake model's.
        device_type: "cpu" keeps gradient buffers between steps, an accelerator frees them.
        bucket_numel: reduce_bucket_size (as the engine resolves it for the backend).
        prefetch_numel: stage3_prefetch_bucket_size.
        gather_dtype_of: the wire dtype of a flat's stage-3 gather.
    """

    def __init__(
        self, ledger: Ledger, units: list[UnitShape], device_type: str, bucket_numel: int, prefetch_numel: int,
    ) -> None:
        self.ledger = ledger
        self.units = units
        self.keep_grads = device_type == "cpu"
        self.device = torch.device("cpu")
        self.flats = {id(f): ReplayFlat(f, self.device) for u in units for f in u.flats}
        self.unit_flats = [[self.flats[id(f)] for f in u.flats] for u in units]
        self.flat_list = [f for fl in self.unit_flats for f in fl]
        self.reducer = _Reducer(self, self.flat_list, bucket_numel)
        self.prefetch_numel = prefetch_numel
        self.sharded = [any(f.shape.params_sharded for f in fl) for fl in self.unit_flats]
        self.reduce_order = list(range(len(units) - 1, 0, -1)) + [0]
        self.in_backward = False
        self._fired: dict[int, set[str]] = {}
        self._next = 0
        self._pending_gathers: dict[int, list[Any]] = {}
        self._handles: list[Any] = []
        self._on_finish: list[Callable[[], None]] = []

    # ------------------------------------------------------------------ model states
    def allocate_states(self) -> None:
        """The states a rank holds from start-up: parameters, masters (sharding/flat.py)."""
        label = self.ledger.label
        for flat in self.flat_list:
            shape, role = flat.shape, flat.shape.role
            if not shape.params_sharded:
                with label(Terms.PARAMS):
                    flat.full = torch.empty(shape.padded_numel, dtype=role.param_dtype, device=self.device)
            elif shape.param_shard_numel:
                with label(Terms.HOST_PARAMS if shape.offload_param else Terms.PARAMS):
                    flat.param_shard = torch.empty(shape.shard_numel, dtype=role.param_dtype, device=self.device)
            start, numel = shape.master_range()
            if shape.master_is_own_copy:
                with label(Terms.HOST_MASTERS if shape.master_on_host else Terms.MASTERS):
                    flat.master = torch.empty(numel, dtype=role.master_dtype, device=self.device)
            elif flat.param_shard is not None:
                flat.master = flat.param_shard
            else:
                flat.master = flat.full.narrow(0, start, numel)

    def allocate_steady_gradients(self) -> None:
        """What a finished step leaves on the CPU: stages 0-1's local buffer, stages 2-3's reduced
        shard (grads/buffers.py `clear_reduced`); nothing on an accelerator."""
        if not self.keep_grads:
            return
        for flat in self.flat_list:
            if flat.shape.policy.reduce_every_backward:
                self.reduced_buffer(flat)
            else:
                self.local_buffer(flat)

    # ------------------------------------------------------------------ gradient buffers
    def local_buffer(self, flat: ReplayFlat) -> torch.Tensor:
        if flat.local is None:
            with self.ledger.label(Terms.GRADIENTS):
                flat.local = torch.empty(flat.shape.padded_numel, dtype=flat.shape.role.grad_accum_dtype,
                                         device=self.device)
        return flat.local

    def reduced_buffer(self, flat: ReplayFlat) -> torch.Tensor:
        if flat.reduced is None:
            dtype = flat.shape.role.grad_accum_dtype
            with self.ledger.label(Terms.GRADIENTS):
                if flat.shape.policy.scatter:
                    flat.reduced = torch.zeros(flat.shape.shard_numel, dtype=dtype, device=self.device)
                else:
                    flat.reduced_full = torch.zeros(flat.shape.padded_numel, dtype=dtype, device=self.device)
                    flat.reduced = flat.master_part(flat.reduced_full)
        return flat.reduced

    def land(self, flat: ReplayFlat, c0: int, c1: int) -> None:
        """Offload's HostGradients.land: the reduced piece, cast, into the host buffer."""
        if not flat.shape.offload_optimizer or not flat.shape.policy.shard_optimizer:
            return
        reduced = flat.reduced
        dtype = flat.shape.role.master_dtype
        if flat.landing is None:
            with self.ledger.label(Terms.HOST_GRADS):
                flat.landing = torch.empty(reduced.numel(), dtype=dtype, device=self.device)
        piece = reduced[c0:c1]
        with self.ledger.label(Terms.GRADIENTS):
            if piece.dtype != dtype:
                piece = piece.to(dtype)
        flat.landing[c0:c1].copy_(piece)

    # ------------------------------------------------------------------ stage 3 gathers
    def _gather(self, index: int) -> None:
        """Start (if not started) and finish the unit's gather."""
        self._start_gather(index)
        self._pending_gathers.pop(index, None)  # the wire buffers die with the completed gather

    def _start_gather(self, index: int) -> None:
        """sharding/flat.py `start_gather` with gather.py's buffers: the full flat; the piece's
        source (a cast of the master when the wire dtype differs from the parameter's) and the
        wire output live until the gather completes; the send buffer (the source copied to the wire
        dtype) until the collective is done, which is counted as the wait (an accelerator's
        process group keeps its inputs until then; gloo frees it when its worker finishes, at
        once for a group of one, and measured alive at the backward's peak on 2 ranks)."""
        if not self.sharded[index] or index in self._pending_gathers:
            return
        flats = [f for f in self.unit_flats[index] if f.shape.params_sharded]
        if all(f.full is not None for f in flats):
            return
        pending = []
        for flat in flats:
            shape, role = flat.shape, flat.shape.role
            with self.ledger.label(Terms.GATHERED):
                flat.full = torch.empty(shape.padded_numel, dtype=role.param_dtype, device=self.device)
            wire = role.gather_dtype
            with self.ledger.label(Terms.GATHER_WIRE):
                if flat.param_shard is not None:
                    source = flat.param_shard
                elif wire == role.param_dtype:
                    continue  # cast straight into this rank's slot: no buffer of its own
                else:
                    source = flat.master.to(role.param_dtype)
                    pending.append(source)
                rows, cols = shape.shard_size, shape.shard_numel
                send = source.to(dtype=wire, copy=True)
                if wire != role.param_dtype:
                    pending.append(torch.empty(rows, cols, dtype=wire, device=self.device))  # the output
                if not self.keep_grads or shape.shard_size > 1:
                    pending.append(send)
                del send
        self._pending_gathers[index] = pending

    def _free(self, index: int) -> None:
        if not self.sharded[index]:
            return
        self._pending_gathers.pop(index, None)
        for flat in self.unit_flats[index]:
            if flat.shape.params_sharded:
                flat.full = None

    def _prefetch(self, index: int, direction: int) -> None:
        budget, j = self.prefetch_numel, index + direction
        while 1 <= j < len(self.units):
            numel = self.units[j].numel
            if numel > budget and j != index + direction:
                return
            budget -= numel
            self._start_gather(j)
            j += direction

    # ------------------------------------------------------------------ hooks
    def attach(self, root: nn.Module) -> None:
        """Hooks on the fake model: unit forwards, output gradients, parameter gradients."""
        for index, unit in enumerate(self.units):
            if index:
                self._handles.append(unit.module.register_forward_pre_hook(self._pre(index)))
                self._handles.append(unit.module.register_forward_hook(self._post(index)))
            for flat in self.unit_flats[index]:
                for name, p in zip(flat.shape.names, flat.shape.params, strict=True):
                    self._handles.append(p.register_post_accumulate_grad_hook(self._grad_hook(index, flat, name)))
        self._handles.append(root.register_forward_pre_hook(lambda m, a: self._gather(0)))
        self._handles.append(root.register_forward_hook(lambda m, a, o: self._root_post()))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _root_post(self) -> None:
        if not self.in_backward:
            for index in range(len(self.units)):
                self._free(index)

    def _pre(self, index: int) -> Callable[..., None]:
        def pre(module: nn.Module, args: Any) -> None:
            self._gather(index)
            self._prefetch(index, -1 if self.in_backward else +1)

        return pre

    def _post(self, index: int) -> Callable[..., None]:
        def post(module: nn.Module, args: Any, output: Any) -> None:
            if not self.in_backward:
                self._free(index)
            for leaf in torch.utils._pytree.tree_leaves(output):
                if isinstance(leaf, torch.Tensor) and leaf.requires_grad and leaf.is_floating_point():
                    leaf.register_hook(self._output_grad(index))

        return post

    def _output_grad(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            self._gather(index)
            self._prefetch(index, -1)

        return hook

    def _grad_hook(self, index: int, flat: ReplayFlat, name: str) -> Callable[[nn.Parameter], None]:
        offset = dict(zip(flat.shape.names, flat.shape.offsets, strict=True))[name]

        def hook(param: nn.Parameter) -> None:
            grad, param.grad = param.grad, None
            if grad is None:
                return
            local = self.local_buffer(flat)
            local.narrow(0, offset, grad.numel()).copy_(grad.reshape(-1))
            del grad
            self._fired.setdefault(index, set()).add(name)
            self._reduce_ready()

        return hook

    def _ready(self, index: int) -> bool:
        expected = sum(len(f.shape.names) for f in self.unit_flats[index])
        return len(self._fired.get(index, ())) >= expected

    def _reduce_ready(self) -> None:
        while self._next < len(self.reduce_order):
            index = self.reduce_order[self._next]
            if not self._ready(index):
                return
            for flat in self.unit_flats[index]:
                self.reducer.add(flat)
            if index:
                self._free(index)
            self._next += 1

    # ------------------------------------------------------------------ a backward
    def start_backward(self) -> None:
        """The gradient reached the root's outputs: stage 3 gathers the root (schedule.py)."""
        self.in_backward = True
        self._gather(0)
        torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    def finish_backward(self) -> None:
        """grads/path.py's epilogue: reduce what is left, wait, free stage 3's units."""
        for index in self.reduce_order[self._next:]:
            for flat in self.unit_flats[index]:
                self.reducer.add(flat)
        self.reducer.finish()
        self._fired.clear()
        self._next = 0
        self.in_backward = False
        for index in range(len(self.units)):
            self._free(index)
