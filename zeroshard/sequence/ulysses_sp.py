"""ALST (Arctic Long Sequence Training): Ulysses sequence parallelism for Hugging Face models.

DeepSpeed's module path and names, so that an ALST script ports by changing its imports:

    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model, core_attn_implementation="sdpa", sequence_parallel_size=2, micro_batch_size=1)
    engine, *_ = zeroshard.initialize(model=model, config=cfg, mpu=mpu)
    dl = UlyssesSPDataLoaderAdapter(dl, sp_rank=mpu.get_sequence_parallel_rank(),
                                    sp_group=mpu.get_sequence_parallel_group(),
                                    sp_world_size=mpu.get_sequence_parallel_world_size(), device=device)

Registration replaces the model's attention function in transformers' attention registry
(`ALL_ATTENTION_FUNCTIONS`) under the core implementation's own name, so the model keeps
following that implementation's code path. The replacement receives each rank's sequence
chunk in transformers' [batch, heads, seq, head_dim] layout, exchanges heads for sequence
(`zeroshard.sequence.layer.exchange_heads`), runs the core attention causally on the whole
sequence for heads/P heads, and exchanges back. Masks are not exchanged: each rank's local
mask means nothing for the whole sequence, so sdpa runs with `is_causal` and eager gets a
causal mask built for the whole sequence (documents packed into one row are not supported).
Positions come from the `position_ids` each rank is given (the data-loader adapter shards
them with the tokens), so rotary embeddings are applied before the exchange, locally.

Tiled compute (`TiledMLP`, `sequence_tiled_compute`, `TiledFusedLogitsLoss`) lives in
zeroshard/sequence/tiled.py and the adapter in zeroshard/sequence/dataloader.py; both are
re-exported here under DeepSpeed's names.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from zeroshard.comm import collectives as comm
from zeroshard.comm.eager_regions import runs_eagerly
from zeroshard.sequence import parallel_state_sp
from zeroshard.sequence.dataloader import UlyssesSPDataLoaderAdapter
from zeroshard.sequence.layer import _EQUAL_SLICES, exchange_heads, head_split
from zeroshard.sequence.shapes import agree_shapes
from zeroshard.sequence.tiled import SequenceTiledCompute, TiledFusedLogitsLoss, TiledMLP, sequence_tiled_compute

__all__ = [
    "UlyssesSPAttentionHF",
    "UlyssesSPDataLoaderAdapter",
    "TiledMLP",
    "SequenceTiledCompute",
    "sequence_tiled_compute",
    "TiledFusedLogitsLoss",
]

# A Hugging Face hub kernel named as attn_implementation: "org/repo", "org/repo@rev", "org/repo:fn".
_HUB_KERNEL = re.compile(r"[^/:@]+/[^/:@]+(?:@[^/:]+)?(?::[^/:]+)?")
_ABSENT = object()
# core implementation name -> (what the registry held before, the installed wrapper)
_REGISTRATIONS: dict[str, tuple[Any, Callable]] = {}


def _eager_of(module: torch.nn.Module) -> Callable:
    """The model file's own `eager_attention_forward` (eager is not in the registry)."""
    found = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if found is None:
        raise ValueError(
            f"core_attn_implementation='eager': {type(module).__module__} has no eager_attention_forward. "
            "Use 'sdpa'."
        )
    return found


class UlyssesSPAttentionHF(torch.nn.Module):
    """Ulysses attention for transformers' attention interface (one instance serves every layer).

    Args: DeepSpeed's. `attn` is the core attention function (None: the calling model's eager
    attention); `process_group` the sequence-parallel group (torch ProcessGroup or
    `zeroshard.comm.Group`); with `seq_length_is_variable=False` every local chunk must be
    `local_seq_length` long; `disable_in_eval` runs the core attention unchanged in eval mode
    (for evaluation on whole, unsharded sequences).
    """

    def __init__(
        self,
        attn: Callable | None,
        batch_size: int,
        attn_head_count: int,
        attn_head_size: int,
        kv_head_count: int,
        num_hidden_layers: int,
        process_group: Any,
        seq_length_is_variable: bool = False,
        local_seq_length: int | None = None,
        global_seq_length: int | None = None,
        disable_in_eval: bool = False,
    ) -> None:
        super().__init__()
        self.attn = attn
        self.group = comm.as_group(process_group)
        self.world_size, self.sp_rank = self.group.size, self.group.rank
        self.batch_size = batch_size
        self.attn_head_count, self.attn_head_size, self.kv_head_count = attn_head_count, attn_head_size, kv_head_count
        self.num_hidden_layers = num_hidden_layers
        self.seq_length_is_variable = seq_length_is_variable
        self.local_seq_length, self.global_seq_length = local_seq_length, global_seq_length
        self.disable_in_eval = disable_in_eval
        _check_heads(attn_head_count, kv_head_count, self.world_size)
        # DeepSpeed's split by key/value group, also for counts the group size does not divide
        # (zeroshard/sequence/layer.py head_split; DeepSpeed's own HF integration refuses those).
        self.q_counts, self.kv_counts, self.kv_index = head_split(attn_head_count, kv_head_count, self.world_size)

    def _core(self, module: torch.nn.Module) -> Callable:
        return self.attn if self.attn is not None else _eager_of(module)

    def forward(
        self, module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any, *args, **kwargs
    ) -> tuple[Tensor, Any]:
        """query/key/value: [batch, heads, local seq, head_dim] -> ([batch, local seq, heads,
        head_dim], attention weights of this rank's heads or None), as a core attention returns."""
        core = self._core(module)
        if self.disable_in_eval and not module.training:
            return core(module, query, key, value, attention_mask, *args, **kwargs)
        # First, so that a rank whose slice is off fails together with the others, not alone
        # (the others would wait in the exchange): every exchange here is sized by these shapes.
        agree_shapes({"query": query, "key": key, "value": value}, self.group, "Ulysses attention (ALST)",
                     _EQUAL_SLICES)
        local = query.shape[2]
        if not self.seq_length_is_variable and local != self.local_seq_length:
            raise ValueError(
                f"local sequence length {local} != seq_length / sequence_parallel_size = {self.local_seq_length}. "
                "Register with seq_length_is_variable=True for batches of varying length."
            )
        if self.kv_index is not None:
            index = torch.tensor(self.kv_index, device=key.device)
            key, value = key.index_select(1, index), value.index_select(1, index)
        q = exchange_heads(query, self.group, 1, 2, self.q_counts, True)  # [b, heads/P, seq, d]
        k = exchange_heads(key, self.group, 1, 2, self.kv_counts, True)
        v = exchange_heads(value, self.group, 1, 2, self.kv_counts, True)
        mask = None if self.attn is not None else _causal_additive_mask(q.shape[2], q.dtype, q.device)
        # The core attention repeats key/value heads by the module's ratio; locally it is q/kv here.
        groups = getattr(module, "num_key_value_groups", None)
        module.num_key_value_groups = q.shape[1] // k.shape[1]
        try:
            out, weights = core(module, q, k, v, mask, *args, **kwargs)  # out: [b, seq, heads/P, d]
        finally:
            if groups is None:
                del module.num_key_value_groups
            else:
                module.num_key_value_groups = groups
        return exchange_heads(out, self.group, 2, 1, self.q_counts, False), weights

    @classmethod
    def register_with_transformers(
        cls,
        model_name_or_path: Any,
        core_attn_implementation: str,
        sequence_parallel_size: int,
        micro_batch_size: int,
        seq_length: int | None = None,
        seq_length_is_variable: bool = True,
        disable_in_eval: bool = False,
    ):
        """Install Ulysses attention under `core_attn_implementation` in transformers' registry
        and return the mpu (`parallel_state_sp`, initialized); None for size 1 (nothing to do).

        `model_name_or_path`: a model (anything with `.config`; then only its own attention
        modules are wrapped) or a local path to its config. Raises ValueError when the model's
        attention implementation is another one, or its head counts do not split over
        `sequence_parallel_size`.
        """
        if sequence_parallel_size == 1:
            return None
        if not seq_length_is_variable and seq_length is None:
            raise ValueError("seq_length_is_variable=False needs seq_length=<the fixed global sequence length>")
        from transformers import AutoConfig
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        model = model_name_or_path if hasattr(model_name_or_path, "config") else None
        config = model.config if model is not None else AutoConfig.from_pretrained(model_name_or_path)
        # Only a loaded model's implementation is resolved: a config read from a path still holds
        # transformers' unresolved default, so there is nothing to compare (DeepSpeed does the same).
        model_impl = getattr(config, "_attn_implementation", None) if model is not None else None
        if model_impl is not None and model_impl != core_attn_implementation:
            # DeepSpeed's wording, so scripts and tests that match it keep working.
            raise ValueError(
                f"core_attn_implementation='{core_attn_implementation}' does not match model config "
                f"attn_implementation='{model_impl}'. Load the model with attn_implementation="
                f"{core_attn_implementation!r}, or register {model_impl!r}."
            )
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        num_q = text.num_attention_heads
        num_kv = getattr(text, "num_key_value_heads", None) or num_q
        _check_heads(num_q, num_kv, sequence_parallel_size)
        if seq_length is not None and seq_length % sequence_parallel_size:
            raise ValueError(
                f"seq_length={seq_length} is not divisible by sequence_parallel_size={sequence_parallel_size}. "
                "Pad the sequences to a multiple of it (UlyssesSPDataLoaderAdapter does)."
            )
        if core_attn_implementation in _REGISTRATIONS:
            raise RuntimeError(
                f"Ulysses attention is already registered for {core_attn_implementation!r}. "
                "Call UlyssesSPAttentionHF.unregister_from_transformers() first."
            )
        if _HUB_KERNEL.fullmatch(core_attn_implementation):
            # transformers loads and registers hub kernels lazily, under their own name.
            from transformers.modeling_flash_attention_utils import lazy_import_flash_attention

            lazy_import_flash_attention(core_attn_implementation)
        if core_attn_implementation == "eager":
            core = None
        elif core_attn_implementation in ALL_ATTENTION_FUNCTIONS:
            core = ALL_ATTENTION_FUNCTIONS[core_attn_implementation]
        else:
            raise ValueError(
                f"core_attn_implementation={core_attn_implementation!r}: not an attention implementation "
                f"transformers knows. Choose one of {['eager', *ALL_ATTENTION_FUNCTIONS.valid_keys()]}."
            )

        if parallel_state_sp.is_initialized():
            if parallel_state_sp.get_sequence_parallel_world_size() != sequence_parallel_size:
                raise ValueError(
                    f"sequence_parallel_size={sequence_parallel_size}, but sequence parallelism is initialized "
                    f"with size {parallel_state_sp.get_sequence_parallel_world_size()}. Destroy it first."
                )
        else:
            parallel_state_sp.initialize_sequence_parallel(sequence_parallel_size)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_q
        local = None if seq_length_is_variable else seq_length // sequence_parallel_size
        ulysses = cls(
            core, micro_batch_size, num_q, head_dim, num_kv, text.num_hidden_layers,
            parallel_state_sp.sequence_parallel_layout().sequence, seq_length_is_variable, local,
            None if seq_length_is_variable else seq_length, disable_in_eval,
        )
        owned = {id(m) for m in model.modules()} if isinstance(model, torch.nn.Module) else None

        # Eager under torch.compile: the exchanges, and `owned`, whose ids would be guards.
        @runs_eagerly("ALST's Ulysses attention: the shape agreement and the head/sequence exchanges")
        def ulysses_attention(module, query, key, value, attention_mask, *args, **kwargs):
            # Attention of another model (or another head layout) in this process is left alone.
            if (owned is not None and id(module) not in owned) or query.shape[1] != num_q:
                base = core if core is not None else _eager_of(module)
                return base(module, query, key, value, attention_mask, *args, **kwargs)
            return ulysses(module, query, key, value, attention_mask, *args, **kwargs)

        previous = ALL_ATTENTION_FUNCTIONS._local_mapping.get(core_attn_implementation, _ABSENT)
        ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = ulysses_attention
        _REGISTRATIONS[core_attn_implementation] = (previous, ulysses_attention)
        return parallel_state_sp

    @classmethod
    def unregister_from_transformers(cls, core_attn_implementation: str | None = None) -> None:
        """Put back what the registry held (all registrations when None) and, once none is
        left, forget the sequence-parallel groups."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        names = list(_REGISTRATIONS) if core_attn_implementation is None else [core_attn_implementation]
        for name in names:
            previous, wrapper = _REGISTRATIONS.pop(name)
            if ALL_ATTENTION_FUNCTIONS._local_mapping.get(name) is wrapper:
                if previous is _ABSENT:
                    del ALL_ATTENTION_FUNCTIONS[name]
                else:
                    ALL_ATTENTION_FUNCTIONS[name] = previous
        if not _REGISTRATIONS:
            parallel_state_sp.destroy_sequence_parallel()


def _check_heads(num_q: int, num_kv: int, world: int) -> None:
    """Any head counts split over the ranks (unevenly where `world` does not divide them), as long
    as every rank gets a query head."""
    if num_q < world:
        raise ValueError(
            f"num_attention_heads={num_q} is less than sequence_parallel_size={world}: a rank would attend over "
            "no head. Pick a sequence-parallel size of at most the head count."
        )
    if num_q % num_kv:
        raise ValueError(f"num_attention_heads={num_q} is not a multiple of num_key_value_heads={num_kv}.")


def _causal_additive_mask(seq: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """[1, 1, seq, seq]: 0 where a position may attend (itself and earlier), the dtype's
    minimum elsewhere, as transformers builds it for eager attention."""
    mask = torch.full((seq, seq), torch.finfo(dtype).min, dtype=dtype, device=device).triu(1)
    return mask[None, None]
