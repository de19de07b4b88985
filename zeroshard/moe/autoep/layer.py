"""`AutoEPMoELayer`: the expert-parallel replacement of a Hugging Face MoE block (DeepSpeed's
`deepspeed.module_inject.auto_ep_layer.AutoEPMoELayer`, same submodule names).

    layer.router.gate.weight                [E, hidden]        the router (dense, replicated)
    layer.router.e_score_correction_bias    [E]                DeepSeek-V3's selection bias (buffer)
    layer.experts.w1 / experts.w3           [L, ffn, hidden]   this rank's L = E / ep_size experts
    layer.experts.w2                        [L, hidden, ffn]
    layer.shared_experts / shared_expert... the model's own dense modules, unchanged

Local expert j is global expert `ep_rank * L + j`, ep_rank = rank % ep_size (expert-parallel
groups are consecutive ranks, zeroshard/sharding/layout.py). The forward computes what the
Hugging Face block computes (zeroshard/moe/autoep/presets.py describes each
family's routing), with a dropless all-to-all in between (auto_ep_dispatch.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zeroshard.comm import collectives as comm
from zeroshard.comm.collectives import Group
from zeroshard.comm.eager_regions import runs_eagerly
from zeroshard.moe.autoep.carry import apply_marks, carried_marks
from zeroshard.moe.autoep.dispatch import combine, dispatch
from zeroshard.moe.autoep.expert_paths import CombineImpl, ExpertPath, choose_path, run_experts, weighted_combine
from zeroshard.moe.autoep.presets import RoutingSettings
from zeroshard.moe.autoep.spec import AutoEPConfig, MoELayerSpec, routing_from_spec
from zeroshard.sharding.layout import ParallelLayout, current_layout, expert_group_name

__all__ = ["AutoEPMoELayer", "AutoEPRouter", "GroupedExperts", "RouterGate"]


class RouterGate(nn.Module):
    """The router's scoring matrix. Its forward returns the router logits, so Hugging Face's
    output recorder (`output_router_logits=True`) can hook it as it hooks the model's router."""

    def __init__(self, hidden: int, num_experts: int, logits_fp32: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.logits_fp32 = logits_fp32

    def forward(self, tokens: Tensor) -> Tensor:
        if self.logits_fp32:
            return F.linear(tokens.float(), self.weight.float())
        return F.linear(tokens, self.weight)


class AutoEPRouter(nn.Module):
    """Token-choice top-k routing: scores (softmax or sigmoid, in fp32), an optional selection
    bias added for choosing only, group-limited choice, the unbiased scores of the chosen
    experts as weights, renormalised if `route_norm`, times `route_scale`."""

    def __init__(
        self, hidden: int, settings: RoutingSettings, selection_bias: Tensor | None, bias_persistent: bool = True
    ) -> None:
        """`selection_bias`: the model's, copied in the form it had: a parameter stays a
        parameter (trainable as it was), a buffer a buffer (`bias_persistent`: in the state dict)."""
        super().__init__()
        self.gate = RouterGate(hidden, settings.num_experts, settings.preset.logits_fp32)
        self.num_experts = settings.num_experts
        self.top_k = settings.top_k
        self.score_func = settings.score_func
        self.route_norm = settings.route_norm
        self.route_scale = settings.route_scale
        self.num_expert_groups = settings.num_expert_groups
        self.num_limited_groups = settings.num_limited_groups
        self.group_score = settings.preset.group_score
        self.weights_in_logits_dtype = settings.preset.weights_in_logits_dtype
        if isinstance(selection_bias, nn.Parameter):
            copied = nn.Parameter(selection_bias.detach().clone(), requires_grad=selection_bias.requires_grad)
            self.e_score_correction_bias = copied
        elif selection_bias is not None:
            self.register_buffer("e_score_correction_bias", selection_bias.detach().clone(), bias_persistent)
        else:
            self.e_score_correction_bias = None

    def bias_to_buffer(self) -> None:
        """Hold a parameter selection bias as a buffer: with load balancing the balancer moves
        it at each step, which an optimizer's master copy of a parameter would undo."""
        bias = self._parameters.pop("e_score_correction_bias", None)
        if bias is not None:
            self.register_buffer("e_score_correction_bias", bias.detach().clone())

    def forward(self, tokens: Tensor, expert_bias: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """tokens [T, hidden] -> (logits [T, E], weights [T, k], selected experts [T, k]).
        `expert_bias` [E]: DeepSpeed's load-balancing bias, added for the choice only."""
        logits = self.gate(tokens)
        if self.score_func == "sigmoid":
            scores = logits.float().sigmoid()
        else:
            scores = F.softmax(logits, dim=-1, dtype=torch.float32)
        choice = scores if expert_bias is None else scores + expert_bias
        biased = expert_bias is not None or self.e_score_correction_bias is not None
        if self.e_score_correction_bias is not None:
            choice = choice + self.e_score_correction_bias
        if self.num_expert_groups is not None:
            choice = self._limit_groups(choice)
        if not biased and self.num_expert_groups is None:
            weights, selected = torch.topk(scores, self.top_k, dim=-1)
        else:
            selected = torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, selected)
        if self.route_norm:
            denominator = weights.sum(dim=-1, keepdim=True)
            if self.score_func == "sigmoid":
                denominator = denominator + 1e-20
            weights = weights / denominator
        if self.route_scale != 1.0:
            weights = weights * self.route_scale
        if self.weights_in_logits_dtype:
            weights = weights.to(logits.dtype)
        return logits, weights, selected

    def _limit_groups(self, choice: Tensor) -> Tensor:
        assert self.num_expert_groups is not None and self.num_limited_groups is not None
        grouped = choice.view(-1, self.num_expert_groups, self.num_experts // self.num_expert_groups)
        if self.group_score == "max":
            group_scores = grouped.max(dim=-1).values
        else:
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        kept = torch.topk(group_scores, k=self.num_limited_groups, dim=-1, sorted=False)[1]
        dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, kept, False)
        return grouped.masked_fill(dropped.unsqueeze(-1), float("-inf")).view(-1, self.num_experts)


class GroupedExperts(nn.Module):
    """This rank's experts as stacked weights; expert j computes w2[j] (act(w1[j] x) * w3[j] x).

    Attributes:
        use_grouped_mm: DeepSpeed's key: False runs the per-expert loop; True (default) a
            grouped path (zeroshard/moe/autoep/expert_paths.py `choose_path`).
        force_native_grouped_mm: DeepSpeed's ``disable_triton_grouped_mm``: torch._grouped_mm
            wherever torch runs it for the device and dtype, not only where it is the fast one.
        path: a fixed path ("loop", "bmm", "grouped_mm") for benchmarks and debugging;
            None (default): chosen per forward.
        last_path: the path the latest forward took.
    """

    def __init__(
        self, dim: int, hidden_dim: int, num_experts: int, use_grouped_mm: bool = True,
        disable_triton_grouped_mm: bool = False, activation: str = "swiglu", activation_alpha: float = 1.702,
        activation_limit: float = 7.0, gate_up_impl: str = "separate",
    ) -> None:
        """DeepSpeed's constructor: `num_experts` experts of uninitialised weights (w1/w3
        [num_experts, hidden_dim, dim], w2 [num_experts, dim, hidden_dim]), marked
        `is_expert_group` as DeepSpeed marks them. AutoEP's layer builds them with
        `from_weights`.

        Raises:
            ValueError: an activation or gate_up_impl zeroshard does not compute (the message
                lists the ones it does).
        """
        super().__init__()
        if gate_up_impl not in ("separate", "fused"):
            raise ValueError(f'gate_up_impl must be "separate" or "fused", got {gate_up_impl!r}')
        self._build(
            torch.empty(num_experts, hidden_dim, dim), torch.empty(num_experts, dim, hidden_dim),
            torch.empty(num_experts, hidden_dim, dim), expert_activation(activation), "", None,
        )
        for p in (self.w1, self.w2, self.w3):
            p.is_expert_group = True
            del p.group_name  # a standalone module belongs to no expert-parallel group yet
        self.use_grouped_mm = use_grouped_mm
        self.force_native_grouped_mm = disable_triton_grouped_mm
        self.activation = activation

    @classmethod
    def from_weights(
        cls, w1: Tensor, w2: Tensor, w3: Tensor, act_fn: nn.Module | None, group_name: str,
        marks: dict[str, dict[str, Any]] | None = None,
    ) -> GroupedExperts:
        """The experts holding `w1`, `w2`, `w3` (taken as they are). `marks`: per stack ("w1",
        "w2", "w3"), the attributes and `requires_grad` it carries over from the weights it was
        built from (zeroshard/moe/autoep/carry.py)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._build(w1, w2, w3, act_fn, group_name, marks)
        return self

    def _build(
        self, w1: Tensor, w2: Tensor, w3: Tensor, act_fn: nn.Module | None, group_name: str,
        marks: dict[str, dict[str, Any]] | None,
    ) -> None:
        self.w1 = nn.Parameter(w1)
        self.w2 = nn.Parameter(w2)
        self.w3 = nn.Parameter(w3)
        self.act_fn = act_fn if act_fn is not None else nn.SiLU()
        for stack, stack_marks in (marks or {}).items():
            apply_marks(getattr(self, stack), stack_marks)
        for p in (self.w1, self.w2, self.w3):  # after the carried marks: these define the stacks
            p.allreduce = False  # DeepSpeed's expert-parameter markers (zeroshard/moe/utils.py)
            p.group_name = group_name
            p.is_expert_group = True  # a stack of expert matrices: Muon orthogonalizes each on its own
        self.use_grouped_mm = True
        self.force_native_grouped_mm = False
        self.path: ExpertPath | None = None
        self.last_path: ExpertPath | None = None

    @property
    def num_local_experts(self) -> int:
        return self.w1.shape[0]

    def forward(self, x: Tensor, counts: list[int] | Tensor) -> Tensor:
        """x [N, hidden], rows grouped by local expert (`counts` rows each, a list or DeepSpeed's
        `num_tokens_per_expert` tensor). Every expert runs, an empty one on zero rows, so each
        slice of the weights gets a gradient (zeros)."""
        if torch.is_tensor(counts):
            counts = [int(c) for c in counts.tolist()]
        path = self.path or choose_path(x, counts, self.w1, self.use_grouped_mm, self.force_native_grouped_mm)
        self.last_path = path
        return run_experts(path, x, counts, self.w1, self.w2, self.w3, self.act_fn)


class AutoEPMoELayer(nn.Module):
    """Expert-parallel replacement of one Hugging Face MoE block; its forward takes and returns
    what the block's does (hidden states [B, S, H] -> [B, S, H])."""

    _is_autoep_layer = True

    def __init__(
        self, spec: MoELayerSpec | nn.Module, source_module: nn.Module | RoutingSettings, ep_size: int, ep_rank: int,
        config: AutoEPConfig | None = None, name: str = "",
    ) -> None:
        """DeepSpeed's constructor, `AutoEPMoELayer(spec, source_module, ep_size, ep_rank,
        config)`; zeroshard's own, `AutoEPMoELayer(source, settings, ep_size, ep_rank, name=)`
        (the swap's), is told apart by its argument types. `name`: the block's name in the
        model, for messages.

        Raises:
            ValueError: a spec zeroshard does not compute, a spec that does not fit the block,
                or `load_balance_coeff` for a family without a selection bias.
        """
        super().__init__()
        if isinstance(spec, MoELayerSpec):
            source, settings = source_module, routing_from_spec(spec, config)
            name = name or spec.moe_module_name
            _check_spec(spec, source)
        else:
            source, settings = spec, source_module
        assert isinstance(source, nn.Module) and isinstance(settings, RoutingSettings)
        preset = settings.preset
        hf_router = getattr(source, preset.router_pattern)
        hf_experts = getattr(source, preset.experts_pattern)
        self.num_experts = settings.num_experts
        self.top_k = settings.top_k
        self.ep_size = ep_size
        self.ep_rank = ep_rank
        self.num_local_experts = settings.num_experts // ep_size
        self.ep_group_name = expert_group_name(ep_size)
        # zeroshard's Group for the layer's own collectives; `ep_group` is torch's handle of it.
        self.expert_group: Group | None = None
        bias, bias_persistent, bias_path = _selection_bias(source, hf_router, preset)
        if bias_path != preset.selection_bias_path:  # found on the block: the export names it there
            preset = replace(preset, selection_bias_path=bias_path)
            settings = replace(settings, preset=preset)
        self.settings = settings
        router_weight = hf_router.weight
        self.hidden_size = router_weight.shape[1]
        self.router = AutoEPRouter(self.hidden_size, settings, bias, bias_persistent)
        # A copy on the source's device and in its dtype (meta too: `zeroshard explain`).
        self.router.gate.weight = nn.Parameter(router_weight.detach().clone())
        prefix = f"{name}." if name else ""
        router_name = f"{prefix}{preset.router_pattern}.weight"
        router_marks = carried_marks(f"{prefix}router.gate.weight", [(router_name, router_weight)])
        apply_marks(self.router.gate.weight, router_marks)
        # Every expert's weights, not only this rank's: all ranks then accept or refuse alike.
        marks = {
            stack: carried_marks(f"{prefix}experts.{stack}", sources)
            for stack, sources in _expert_sources(hf_experts, preset, f"{prefix}{preset.experts_pattern}").items()
        }
        w1, w2, w3 = _local_expert_weights(hf_experts, preset, ep_rank * self.num_local_experts, self.num_local_experts)
        self.experts = GroupedExperts.from_weights(
            w1, w2, w3, getattr(hf_experts, "act_fn", None), self.ep_group_name, marks
        )
        for p in (self.experts.w1, self.experts.w2, self.experts.w3):
            # Where this rank's stack sits in the global [E, ...] one (experts are contiguous
            # blocks along dim 0): checkpoints save and load the global tensor, so they are the
            # same for every autoep_size (zeroshard/checkpoint/names.py).
            p.autoep_global_shape = (settings.num_experts, *p.shape[1:])
            p.autoep_offset = ep_rank * p.numel()
        self.shared_expert_names: list[str] = []
        for name in (preset.shared_experts_pattern, preset.shared_experts_gate_pattern):
            if name and getattr(source, name, None) is not None:
                setattr(self, name, getattr(source, name))
                self.shared_expert_names.append(name)
        self.shared_experts_pattern = preset.shared_experts_pattern
        self.shared_experts_gate_pattern = preset.shared_experts_gate_pattern
        # Mixtral's router_jitter_noise: inputs scaled by U(1 - j, 1 + j) in training.
        self.jitter_noise = float(getattr(source, "jitter_noise", 0.0) or 0.0)
        # Routes per global expert since the last optimizer step (auxiliary-loss-free balancing).
        self.tokens_per_expert: Tensor | None = None
        self.count_tokens = False
        self.combine_impl: CombineImpl = "weighted_sum"
        if isinstance(spec, MoELayerSpec):
            self._adopt_spec(spec, config if config is not None else AutoEPConfig())

    def _adopt_spec(self, spec: MoELayerSpec, config: AutoEPConfig) -> None:
        """DeepSpeed's construction: the config's kernel and balance settings, the spec's activation."""
        self.model_family = spec.model_family
        self.load_balance_coeff = config.load_balance_coeff
        if config.load_balance_coeff is not None and (
            not spec.supports_expert_bias or self.router.e_score_correction_bias is None
        ):
            raise ValueError(
                f"AutoEP preset '{spec.model_family}' does not support load_balance_coeff/expert_bias: its router has "
                "no selection bias (e_score_correction_bias) to move. Set load_balance_coeff=None."
            )
        self.count_tokens = config.load_balance_coeff is not None
        if self.count_tokens:
            self.router.bias_to_buffer()
        self.set_expert_kernels(config.use_grouped_mm, config.disable_triton_grouped_mm, config.combine_impl)
        self.experts.act_fn = expert_activation(spec.expert_activation)

    def set_expert_kernels(self, use_grouped_mm: bool, disable_triton_grouped_mm: bool, combine_impl: str) -> None:
        """DeepSpeed's three kernel keys (expert_parallel section; docs/moe.md says what each does here)."""
        self.experts.use_grouped_mm = use_grouped_mm
        self.experts.force_native_grouped_mm = disable_triton_grouped_mm
        self.combine_impl = "legacy_bmm" if combine_impl == "legacy_bmm" else "weighted_sum"

    @property
    def ep_group(self) -> Any:
        """The expert-parallel torch ProcessGroup, as DeepSpeed's layer holds it (users pass it
        to torch.distributed: `dist.get_world_size(group=layer.ep_group)`). None before
        `set_deepspeed_parallelism`, and for autoep_size 1, whose group of one has no torch
        process group (zeroshard never communicates in it)."""
        return None if self.expert_group is None else self.expert_group.handle

    @ep_group.setter
    def ep_group(self, group: Any) -> None:
        # DeepSpeed code assigns a torch ProcessGroup; zeroshard's own Group is taken as is.
        self.expert_group = group if group is None or isinstance(group, Group) else comm.group_of(group)

    def set_deepspeed_parallelism(
        self, use_data_before_expert_parallel_: bool = False, folding_group_handles: Any = None,
        layout: ParallelLayout | None = None,
    ) -> None:
        """Attach the expert-parallel group of `layout` (the engine's; else the process's one
        layout, which builds it once per size, collectively). DeepSpeed's signature; its two
        options are refused, as zeroshard's `MoE` refuses the first.

        Raises:
            ValueError: `use_data_before_expert_parallel_=True` or `folding_group_handles`.
        """
        if use_data_before_expert_parallel_:
            raise ValueError(
                "use_data_before_expert_parallel_=True: not supported by zeroshard (expert-parallel groups are "
                "consecutive ranks). Leave it False."
            )
        if folding_group_handles is not None:
            raise ValueError(
                "folding_group_handles: zeroshard's AutoEP does not fold expert parallelism with tensor "
                "parallelism (tensor_parallel.autotp_size 1). Leave it None."
            )
        self.expert_group, _ = (layout if layout is not None else current_layout()).expert_groups(self.ep_size)

    def global_expert_index(self, local_index: int) -> int:
        return self.ep_rank * self.num_local_experts + local_index

    @runs_eagerly("the AutoEP layer: routing and the dropless token exchange (comm/eager_regions.py's note)")
    def forward(self, hidden_states: Tensor) -> Tensor:
        shape = hidden_states.shape
        if self.training and self.jitter_noise > 0:  # the same draw as the Hugging Face block's
            noise = torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
            hidden_states = hidden_states * noise
        tokens = hidden_states.reshape(-1, shape[-1])
        if self.ep_size > 1 and self.expert_group is None:
            raise RuntimeError(
                f"AutoEPMoELayer with autoep_size={self.ep_size} has no expert-parallel group: call "
                "set_deepspeed_parallelism() (zeroshard.initialize does) before the forward."
            )
        _, weights, selected = self.router(tokens)
        # Only training forwards (train mode, grad enabled) steer the balance: an evaluation, in
        # eval() or under torch.no_grad(), must not move the next step's bias (docs/moe.md).
        if self.count_tokens and self.training and torch.is_grad_enabled():
            counts = torch.bincount(selected.reshape(-1), minlength=self.num_experts).float()
            self.tokens_per_expert = counts if self.tokens_per_expert is None else self.tokens_per_expert + counts
        group = self.expert_group if self.ep_size > 1 else None
        routed, plan, order = dispatch(tokens, selected, self.num_experts, group, self.num_local_experts)
        expert_out = self.experts(routed, plan.local_counts)
        per_route = combine(expert_out, plan, order, group, selected.numel())
        # Weighted sum over each token's k routes, in the weights' dtype (fp32 for Mixtral
        # and DeepSeek, the hidden dtype for Qwen), as the Hugging Face experts apply them.
        out = weighted_combine(per_route.view(*selected.shape, -1), weights, self.combine_impl)
        out = out.to(hidden_states.dtype)
        shared = self._shared(tokens)
        if shared is not None:
            out = out + shared
        return out.view(shape)

    def _shared(self, tokens: Tensor) -> Tensor | None:
        name, gate_name = self.shared_experts_pattern, self.shared_experts_gate_pattern
        if not name or name not in self.shared_expert_names:
            return None
        out = getattr(self, name)(tokens)
        if gate_name and gate_name in self.shared_expert_names:
            out = torch.sigmoid(getattr(self, gate_name)(tokens)) * out
        return out


_ACTIVATIONS = {"swiglu": lambda: nn.SiLU(), "geglu_tanh": lambda: nn.GELU(approximate="tanh")}


def expert_activation(name: str) -> nn.Module:
    """The gate activation of DeepSpeed's expert activation `name` (experts compute
    act(w1 x) * w3 x).

    Raises:
        ValueError: a form zeroshard does not compute (the clamped SwiGLU variants).
    """
    if name not in _ACTIVATIONS:
        raise ValueError(
            f"expert activation {name!r}: zeroshard's AutoEP experts compute {', '.join(_ACTIVATIONS)} only. Use one "
            "of them, or leave expert_parallel off for this model."
        )
    return _ACTIVATIONS[name]()


def _selection_bias(source: nn.Module, router: nn.Module, preset) -> tuple[Tensor | None, bool, str | None]:
    """The block's selection bias (a parameter or a buffer, on the router, on the block or on
    the submodule `preset.selection_bias_path`), whether it is a persistent buffer, and where
    it was found (None: the router; "": the block). Without a path, a bias the router does not
    register but the block does is the block's (some models keep it beside the router)."""
    attr = preset.selection_bias
    if not attr:
        return None, True, preset.selection_bias_path
    path = preset.selection_bias_path

    def registers(module: nn.Module) -> bool:
        return attr in module._parameters or attr in module._buffers

    if path is None and not registers(router) and registers(source):
        path = ""
    owner = router if path is None else (source if path == "" else source.get_submodule(path))
    bias = getattr(owner, attr, None)
    if bias is not None and not torch.is_tensor(bias):
        raise ValueError(
            f"{type(owner).__name__}.{preset.selection_bias} is a {type(bias).__name__}, not a tensor: AutoEP copies "
            "the selection bias as a parameter or a buffer. Register it as one (register_buffer or nn.Parameter)."
        )
    return bias, attr not in getattr(owner, "_non_persistent_buffers_set", set()), path


def _check_spec(spec: MoELayerSpec, source: nn.Module) -> None:
    """The spec's sizes against the block's weights: a wrong spec would build experts of
    the wrong shape silently."""
    router = getattr(source, spec.router_name, None)
    if router is None or not hasattr(source, spec.experts_name):
        raise ValueError(
            f"MoELayerSpec ({spec.moe_module_name}): the block has no router {spec.router_name!r} or experts "
            f"{spec.experts_name!r} (it has {', '.join(n for n, _ in source.named_children())}). Set router_name "
            "and experts_name to its children."
        )
    shape = tuple(router.weight.shape)
    if shape != (spec.num_experts, spec.hidden_size):
        raise ValueError(
            f"MoELayerSpec ({spec.moe_module_name}): num_experts={spec.num_experts}, hidden_size={spec.hidden_size} "
            f"but the router weight is {list(shape)}. Set them to the block's sizes."
        )


def _expert_sources(experts: nn.Module, preset, prefix: str) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Per stack ("w1", "w2", "w3"), the parameters (with their names) it is built from, over
    every expert of the block."""
    if isinstance(experts, nn.ModuleList):
        names = {"w1": preset.expert_w1, "w2": preset.expert_w2, "w3": preset.expert_w3 or "up_proj"}
        out: dict[str, list[tuple[str, nn.Parameter]]] = {}
        for stack, attr in names.items():
            out[stack] = []
            for i, expert in enumerate(experts):
                part = getattr(expert, attr)
                if isinstance(part, nn.Module):
                    out[stack].append((f"{prefix}.{i}.{attr}.weight", part.weight))
                else:
                    out[stack].append((f"{prefix}.{i}.{attr}", part))
        return out

    def source(attr: str) -> list[tuple[str, nn.Parameter]]:
        part = getattr(experts, attr)
        if isinstance(part, nn.Module):
            return [(f"{prefix}.{attr}.weight", part.weight)]
        return [(f"{prefix}.{attr}", part)]

    w1 = source(preset.expert_w1)
    # A fused gate-up tensor is the source of both w1 and w3.
    w3 = w1 if preset.expert_w3 is None else source(preset.expert_w3)
    return {"w1": w1, "w2": source(preset.expert_w2), "w3": w3}


def _local_expert_weights(experts: nn.Module, preset, first: int, count: int) -> tuple[Tensor, Tensor, Tensor]:
    """This rank's slice of the experts' weights, split into w1/w2/w3 ([L, ffn, hidden] for
    w1 and w3, [L, hidden, ffn] for w2), copied (the source block is dropped)."""
    if isinstance(experts, nn.ModuleList):  # one module per expert (older layouts)
        picked = list(experts)[first:first + count]
        w1 = torch.stack([_weight(getattr(e, preset.expert_w1)) for e in picked])
        w2 = torch.stack([_weight(getattr(e, preset.expert_w2)) for e in picked])
        w3 = torch.stack([_weight(getattr(e, preset.expert_w3 or "up_proj")) for e in picked])
        return w1, w2, w3
    w2 = _weight(getattr(experts, preset.expert_w2))[first:first + count].detach().clone()
    w1_full = _weight(getattr(experts, preset.expert_w1))[first:first + count].detach()
    if preset.expert_w3 is None:  # fused [E, 2*ffn, hidden]: gate rows first, then up
        ffn = w1_full.shape[1] // 2
        return w1_full[:, :ffn].clone(), w2, w1_full[:, ffn:].clone()
    w3 = _weight(getattr(experts, preset.expert_w3))[first:first + count].detach().clone()
    return w1_full.clone(), w2, w3


def _weight(obj) -> Tensor:
    return obj.weight.detach() if isinstance(obj, nn.Module) else obj.detach()
