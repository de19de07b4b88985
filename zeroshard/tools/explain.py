"""What a config resolves to: the data behind `zeroshard explain` and its text.

`explain_data` returns the precision plan per parameter group, the defaults applied, the keys
accepted with no effect and the per-rank memory estimate as a dict (the CLI's --json);
`print_tables` renders it; `explain_text` is the rendered text as a string (the demo writes it
next to its run). A bad config raises `ConfigError`; a bad --model or --params `UsageError`.
"""

from __future__ import annotations

import io
import warnings
from typing import Any

from zeroshard.comm.watchdog import resolve_timeouts
from zeroshard.config.monitor import monitor_destinations
from zeroshard.config.preemption import signal_number
from zeroshard.config.schema import ConfigError, ZeroshardConfig
from zeroshard.grads.tree_reduce import NORM_BLOCK_NUMEL
from zeroshard.precision.plan import assign_param_groups
from zeroshard.resolve import resolve_config
from zeroshard.tools.explain_memory import memory_keys, model_spec_for, print_memory_plan, states_only_keys
from zeroshard.tools.explain_model import (
    UsageError,
    attention_split,
    build_model_on_meta,
    hf_model_on_meta,
    model_report,
    preset_names,
    unit_numels,
)
from zeroshard.tools.memory import MemoryEstimate, bytes_per_param, estimate_for_config, optimizer_state_count

__all__ = [
    "ConfigError", "UsageError", "build_model_on_meta", "explain_data", "explain_text", "preset_names", "print_tables",
]

ROLE_ROWS = (
    ("param", "module parameters"),
    ("compute", "compute"),
    ("grad", "gradient (autograd)"),
    ("grad_accum", "gradient accumulation"),
    ("reduce", "reduce (wire)"),
    ("gather", "all-gather (wire)"),
    ("master", "master weights"),
    ("optimizer_state", "optimizer state"),
)
# How many parameter names per group the table shows (JSON lists them all).
_NAMES_SHOWN = 6


# ---------------------------------------------------------------------------------------------
# explain
# ---------------------------------------------------------------------------------------------


def explain_data(
    config_path: str,
    world_size: int,
    model_spec: str | None = None,
    num_params: int | None = None,
    *,
    hf_config: str | None = None,
    seq: int | None = None,
    micro_batch: int | None = None,
    activation_checkpointing: bool = False,
    device: str = "cuda",
) -> dict[str, Any]:
    """Everything `zeroshard explain` shows, as a JSON-ready dict.

    With a model (`model_spec`, or `hf_config`: a Hugging Face config.json) the memory plan
    (`memory.device_peak_bytes` and the rest, tools/explain_memory.py) comes from tracing one
    training step at `micro_batch` (default: the config's) and `seq` (default: the model's
    longest), for `device` ("cuda": an accelerator, "cpu").

    Raises:
        ConfigError: for a bad config; UsageError: for a bad model spec.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # explain lists the no-effect keys itself
        config = resolve_config(config_path, world_size=world_size)
    plan = config.precision_plan
    data: dict[str, Any] = {
        "config": str(config_path),
        "world_size": world_size,
        "zero_stage": config.zero_optimization.stage,
        "batch": {
            "train_batch_size": config.train_batch_size,
            "train_micro_batch_size_per_gpu": config.train_micro_batch_size_per_gpu,
            "gradient_accumulation_steps": config.gradient_accumulation_steps,
            "derived": list(config.derived_keys),
        },
        "optimizer": config.optimizer.type if config.optimizer else None,
        "placement": _placement(config),
        "precision": plan.as_dict(),
        "defaults_applied": list(config.defaults_applied),
        "no_effect_keys": list(config.no_effect_keys),
        "monitors": monitor_destinations(config),
        "parallel": _parallel_layout(config.sequence_parallel_size, world_size),
        "model": None,
        "moe": None,
        "autoep": _autoep_given(config) if config.expert_parallel.enabled else None,
        "tensor_parallel": _tensor_parallel_given(config, world_size),
        "checkpointing": _checkpointing(config),
        "reduction": _reduction(config, world_size),
        "hangs": _hangs(config),
    }
    estimate: MemoryEstimate | None = None
    plan_keys: dict[str, Any] | None = None
    if hf_config is not None:
        model_spec = None
    if model_spec is not None or hf_config is not None:
        model = build_model_on_meta(model_spec) if hf_config is None else hf_model_on_meta(hf_config)
        model_spec = model_spec or f"hf-config {hf_config}"
        if config.expert_parallel.enabled:
            from zeroshard.moe.autoep.swap import replace_moe_layers

            settings, names = replace_moe_layers(model, config.expert_parallel, world_size)
            data["autoep"] = {"autoep_size": config.expert_parallel.autoep_size, "layers": names,
                              "settings": settings.explain_lines()}
        data["model"] = {"spec": model_spec, **model_report(model, plan)}
        if config.sequence_parallel_size > 1:
            data["parallel"]["attention"] = attention_split(model, config.sequence_parallel_size)
        if plan.fp8 is not None:
            from zeroshard.precision.fp8 import fp8_linear_plan

            data["model"]["fp8"] = [
                {"module": c.name, "in_features": c.in_features, "out_features": c.out_features, "fp8": c.fp8,
                 "why": c.reason}
                for c in fp8_linear_plan(model, plan.fp8)
            ]
        counts = {g: info["num_params"] for g, info in data["model"]["groups"].items()}
        estimate_world = None
        if config.tensor_parallel.size > 1:
            from zeroshard.autotp.report import tensor_parallel_report

            data["tensor_parallel"], counts = tensor_parallel_report(
                model, config.tensor_parallel, config.tensor_parallel.size, world_size,
                assign_param_groups(plan, model),
            )
            # Each rank's pieces and whole parameters, sharded over its data-parallel group.
            estimate_world = world_size // config.tensor_parallel.size
        units = unit_numels(model, config)
        if units is not None:
            data["model"]["units"] = {"count": len(units), "largest_numel": max(units, default=0)}
        from zeroshard.moe.report import moe_report

        data["moe"], expert_counts = moe_report(model, world_size, assign_param_groups(plan, model))
        for by_group in expert_counts.values():  # experts are estimated over their own groups
            for group, numel in by_group.items():
                counts[group] -= numel
        estimate = estimate_for_config(config, plan, counts, world_size=estimate_world, unit_numels=units,
                                       expert_counts=expert_counts)
        if estimate_world is not None:
            estimate.assumptions.append(
                f"tensor parallel {config.tensor_parallel.size}: each rank holds 1/{config.tensor_parallel.size} of "
                f"every split layer and all of the rest ({sum(counts.values()):,} parameters), sharded over "
                f"{estimate_world} data-parallel ranks"
            )
        if expert_counts or config.expert_parallel.enabled:
            plan_keys = states_only_keys(estimate, config, device, "MoE experts: the peak is the states and buffer "
                                         "bounds; expert models are not traced yet")
        elif estimate_world is not None:
            plan_keys = states_only_keys(estimate, config, device, "tensor parallelism: the peak is the states and "
                                         "buffer bounds of each rank's pieces; split models are not traced yet")
        else:
            try:
                spec = model_spec_for(None if hf_config else model_spec, hf_config)
                plan_keys = memory_keys(config, world_size, spec, seq=seq, micro_batch=micro_batch,
                                        activation_checkpointing=activation_checkpointing, device=device)
            except ValueError as exc:
                raise UsageError(str(exc)) from None
        if config.optimizer is not None and config.optimizer.type.lower() == "muon":
            from zeroshard.optim.muon.optimizer import muon_param_plan
            from zeroshard.optim.muon.plan_report import muon_group_report

            choices = muon_param_plan(model, config.optimizer.params)
            masters = {role.master_dtype for role in plan.groups.values()}
            data["model"]["muon"] = {
                "muon": [c.name for c in choices if c.use_muon],
                "adamw": [c.name for c in choices if not c.use_muon],
                "reasons": {c.name: c.reason for c in choices},
                "groups": muon_group_report(model, config.optimizer.params, min(masters, key=lambda d: d.itemsize),
                                            config.zero_optimization.optimizer_offload),
            }
    elif num_params is not None:
        estimate = estimate_for_config(config, plan, num_params)
        plan_keys = states_only_keys(estimate, config, device, "no model: activations are not included "
                                     "(give --model or --hf-config for the traced peak)")
    states = optimizer_state_count(
        config.optimizer.type if config.optimizer else None, config.optimizer.params if config.optimizer else None
    )
    per_param = {}
    zero = config.zero_optimization
    offloaded = zero.optimizer_offload or zero.param_offload
    for group in plan.groups:
        replicated, sharded = bytes_per_param(plan, zero.stage, states, group, offloaded=offloaded)
        per_param[group] = {"replicated": replicated, "sharded": sharded}
    data["memory"] = {
        "bytes_per_param": per_param,
        "estimate": estimate.as_dict() if estimate else None,
        **(plan_keys or {}),
    }
    return data


def _print_tensor_parallel(console: Any, tensor: dict[str, Any]) -> None:
    from rich.table import Table

    console.print(
        f"\ntensor parallelism (AutoTP): {tensor['data_parallel_size']} data x {tensor['autotp_size']} tensor ranks; "
        f"tensor groups {tensor['tensor_groups']} (consecutive), data groups {tensor['data_groups']}; rules: "
        f"{tensor['rules']}",
        soft_wrap=True,
    )
    if tensor["layers"] is None:
        console.print("  (give --model to see each layer's split)")
        return
    table = Table(title="Tensor-parallel split per Linear layer")
    table.add_column("layer", overflow="fold")  # the rule each followed: --json
    for column in ("split", "whole shape", "piece per rank"):
        table.add_column(column, no_wrap=True)
    for layer in tensor["layers"]:
        split = layer["split"] + (", output gathered" if layer["gather_output"] else "")
        table.add_row(layer["name"], split, str(layer["shape"]), str(layer["piece"]))
    console.print(table)
    if tensor["grad_sum"]:
        console.print(f"  kept whole, gradient summed over the tensor group: {', '.join(tensor['grad_sum'])}",
                      soft_wrap=True)
    for warning in tensor["warnings"]:
        console.print(f"  note: {warning}", soft_wrap=True)


def _print_muon_groups(console: Any, groups: list[dict[str, Any]]) -> None:
    from rich.table import Table

    table = Table(title="Muon: optimizer groups")
    for column in ("group", "lr", "Newton-Schulz matrices (tensors x cut)", "ns_method", "NS dtype"):
        table.add_column(column)
    for g in groups:
        if g["optimizer"] != "Muon":
            table.add_row("AdamW", f"{g['lr']:g}", f"none ({g['tensors']} tensors)", "-", "-")
            continue
        blocks = "\n".join(f"{count} x {cut}" for cut, count in g["blocks"].items())
        dtypes = "\n".join(f"{where} {dtype}" for where, dtype in g["ns_compute_dtype"].items())
        label = "Muon\nper-head" if g["per_head"] else "Muon\nwhole"
        table.add_row(label, f"{g['lr']:g}", blocks, f"{g['ns_method']}\n{g['ns_steps']} steps",
                      f"{g['ns_dtype']}:\n{dtypes}")
    console.print(table)


def _tensor_parallel_given(config: ZeroshardConfig, world_size: int) -> dict[str, Any] | None:
    """The tensor-parallel groups (the layers are listed with --model)."""
    size = config.tensor_parallel.size
    if size <= 1:
        return None
    from zeroshard.autotp.report import tensor_parallel_layout

    tp = config.tensor_parallel
    rules = (f"preset_model={tp.preset_model}" if tp.preset_model else "") + (
        " + partition_config" if tp.partition_config else ""
    )
    return {**tensor_parallel_layout(size, world_size), "rules": rules or "the model's tp_plan", "layers": None,
            "grad_sum": [], "warnings": []}


def _autoep_given(config: ZeroshardConfig) -> dict[str, Any]:
    """AutoEP without a model: the routing keys the config sets; the rest come from the model."""
    ep = config.expert_parallel
    keys = ("preset_model", "top_k", "score_func", "route_norm", "route_scale", "routed_scaling_factor",
            "num_expert_groups", "num_limited_groups", "load_balance_coeff")
    given = [f"expert_parallel.{k} = {getattr(ep, k)}  (config)" for k in keys
             if getattr(ep, k) not in (None, "auto")]
    given.append("the other routing settings: from the model's config at initialize (give --model to see them)")
    return {"autoep_size": ep.autoep_size, "layers": None, "settings": given}


def _placement(config: ZeroshardConfig) -> dict[str, Any]:
    """Where each role lives (ZeRO-Offload moves some to the host, zeroshard/sharding/offload.py)."""
    zero = config.zero_optimization
    host_params = zero.param_offload and zero.stage == 3
    return {
        "params": "host (shard; gathered on the device)" if host_params else "device",
        "gradients": "device (reduced shard copied to the host per bucket)" if zero.optimizer_offload else "device",
        "master_weights": "host" if zero.optimizer_offload else "device",
        "optimizer_state": "host" if zero.optimizer_offload else "device",
        "optimizer_step": "host CPU (fused CPU Adam)" if zero.optimizer_offload else "device",
        "pin_memory": zero.offload_pin_memory,
    }


def _reduction(config: Any, world_size: int) -> dict[str, Any]:
    """How a step's gradients are summed (docs/deterministic-reduction.md)."""
    data = max(1, world_size // config.sequence_parallel_size)
    micro_batches = data * config.gradient_accumulation_steps
    return {
        "deterministic": config.zeroshard.deterministic_reduction,
        "micro_batches_per_step": micro_batches,
        "shard_align": NORM_BLOCK_NUMEL if config.zeroshard.deterministic_reduction else 1,
    }


def _reduction_line(reduction: dict[str, Any]) -> str:
    n = reduction["micro_batches_per_step"]
    if reduction["deterministic"]:
        return (f"reduction: deterministic, one pairwise tree over the {n} micro-batches of a step: the same bits "
                "at every power-of-two world size (or any, without accumulation) with this micro-batch and "
                f"train_batch_size; shards cut at multiples of {reduction['shard_align']} "
                "(zeroshard.deterministic_reduction)")
    return ("reduction: the collectives' order, which depends on the world size "
            "(zeroshard.deterministic_reduction: the same bits at any world size)")


def _checkpointing(config: ZeroshardConfig) -> dict[str, Any]:
    """How saves are written (checkpoint.writer.decoupled) and what a scheduler's signal does
    (the preemption section; docs/cluster.md)."""
    writer = config.checkpoint.writer
    preemption = config.preemption
    return {
        "asynchronous": bool(writer is not None and writer.decoupled),
        "tag_validation": config.checkpoint.tag_validation,
        "preemption": None if not preemption.enabled else {
            "signals": [signal_number(name).name for name in preemption.signals],
            "save_dir": preemption.save_dir, "tag": preemption.tag,
            "exit_code": preemption.exit_code, "resume": preemption.resume,
        },
    }


def _hangs(config: ZeroshardConfig) -> dict[str, Any]:
    """When a stuck or divergent job is named, and when a collective fails (docs/reliability.md,
    "No silent hangs")."""
    extras = config.zeroshard
    timeouts = resolve_timeouts(extras.hang_timeout_s, extras.hang_first_step_timeout_s, extras.collective_timeout_s)[0]
    return {
        "watchdog": timeouts.enabled, "hang_timeout_s": timeouts.hang_timeout_s,
        "hang_first_step_timeout_s": timeouts.first_step_timeout_s, "collective_timeout_s": extras.collective_timeout_s,
        "tick_s": timeouts.tick_s,
    }


def _hang_line(hangs: dict[str, Any]) -> str:
    limit = f"collectives time out after {hangs['collective_timeout_s']:g} s (zeroshard.collective_timeout_s)"
    if not hangs["watchdog"]:
        return f"hangs: watchdog off (zeroshard.hang_timeout_s 0); {limit}"
    tick = hangs["tick_s"]
    return (f"hangs: the watchdog names a stuck or divergent job on every rank after {hangs['hang_timeout_s']:g} s "
            f"waiting ({hangs['hang_first_step_timeout_s']:g} s in a process's first step; ranks deadlocked on "
            f"each other within a few {tick:g} s ticks); {limit}")


def _checkpointing_lines(checkpointing: dict[str, Any]) -> list[str]:
    lines = [
        "checkpoints: asynchronous (checkpoint.writer.decoupled): save_checkpoint returns once the state is in "
        "host memory and a background thread writes the files"
        if checkpointing["asynchronous"] else "checkpoints: written before save_checkpoint returns"
    ]
    preemption = checkpointing["preemption"]
    if preemption is None:
        lines.append("preemption: off (a signal ends the run as it would without zeroshard)")
        return lines
    signals = ", ".join(preemption["signals"]) or "no signals"
    if preemption["save_dir"]:
        tag = preemption["tag"] or "global_step<N>"
        then = (f"the ranks save to {preemption['save_dir']} (tag {tag}) at the step boundary where they agree, "
                f"then every rank exits {preemption['exit_code']}")
    else:
        then = "engine.should_stop() turns true on every rank at the same step (no save_dir: the loop saves itself)"
    lines.append(f"preemption: {signals} -> {then}")
    if preemption["resume"]:
        lines.append(f"  at initialize: resume from the newest complete checkpoint in {preemption['save_dir']}")
    return lines


def _replicas(data: dict[str, Any]) -> str:
    parallel = data.get("parallel") or {}
    tensor = data.get("tensor_parallel")
    if tensor:  # DeepSpeed 0.19.8 counts every rank (docs/tensor-parallel.md)
        return (f"world {data['world_size']} (every rank counts, as in DeepSpeed: {tensor['data_parallel_size']} "
                f"data-parallel x {tensor['autotp_size']} tensor ranks; distinct samples per step: 1/"
                f"{tensor['autotp_size']} of it)")
    if parallel.get("sequence_parallel_size", 1) > 1:
        sp, dp = parallel["sequence_parallel_size"], parallel["data_parallel_size"]
        return f"data-parallel {dp} (world {data['world_size']} / sequence {sp})"
    return f"world {data['world_size']}"


def _parallel_layout(sequence_parallel_size: int, world_size: int) -> dict[str, Any]:
    """The (data, sequence) layout (docs/design.md section 9) and its activation-memory effect."""
    sp = sequence_parallel_size
    return {
        "sequence_parallel_size": sp,
        "data_parallel_size": world_size // sp,
        "sequence_groups": [list(range(i, i + sp)) for i in range(0, world_size, sp)],
        "data_groups": [list(range(i, world_size, sp)) for i in range(sp)],
        "dense_sharded_over": world_size,
        # Everything per position (embeddings, MLPs, norms, logits) holds 1/P of the sequence;
        # attention holds the whole sequence for 1/P of the heads: the same fraction.
        "activation_fraction": 1 / sp,
    }


def _human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def print_tables(data: dict[str, Any], file: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=file)
    precision = data["precision"]
    batch = data["batch"]
    console.print(
        f"[bold]{data['config']}[/bold]: ZeRO stage {data['zero_stage']}, world size {data['world_size']}, "
        f"precision mode [bold]{precision['mode']}[/bold]"
    )
    derived = f" ({', '.join(batch['derived'])} derived)" if batch["derived"] else ""
    console.print(
        f"batch: train_batch_size {batch['train_batch_size']} = micro {batch['train_micro_batch_size_per_gpu']}"
        f" x accumulation {batch['gradient_accumulation_steps']} x {_replicas(data)}{derived}"
    )

    table = Table(title="Precision plan (dtype per tensor role and parameter group)")
    table.add_column("role")
    groups = precision["groups"]
    model = data["model"]
    for group in groups:
        header = group
        if model is not None:
            header += f"\n{model['groups'][group]['num_params']:,} params"
        table.add_column(header)
    for key, label in ROLE_ROWS:
        table.add_row(label, *(str(groups[g][key]) for g in groups))
    scale = precision["loss_scale"]
    scale_text = scale["kind"]
    if scale["kind"] in ("dynamic", "grad_scaler"):
        scale_text += f" (init {scale['init_scale']:g}, window {scale['window']}, hysteresis {scale['hysteresis']})"
    elif scale["kind"] == "static":
        scale_text += f" ({scale['init_scale']:g})"
    table.add_row("loss scaling", *([scale_text] * len(groups)))
    console.print(table)
    keys = precision.get("overflow_keys") or "always with fp16 loss scaling"
    console.print(f"skip steps with non-finite gradients: {precision['check_grad_overflow']} ({keys})")
    console.print(_reduction_line(data["reduction"]))
    console.print(f"floating buffers: {precision.get('buffers', 'own dtype')} (data_types.buffer_dtype)")
    place = data["placement"]
    console.print(
        "where each role lives: " + ", ".join(f"{k} {v}" for k, v in place.items() if k != "pin_memory")
        + (" (host buffers pinned)" if place["pin_memory"] else "")
    )
    for note in precision["notes"]:
        console.print(f"note: {note}")
    for choice in precision.get("lossy", []):
        console.print(f"[bold]LOSSY[/bold]: {choice}", highlight=False)

    if model is not None:
        console.print(f"\nmodel [bold]{model['spec']}[/bold]: {model['num_params']:,} parameters")
        for group, info in model["groups"].items():
            names = info["params"]
            shown = ", ".join(names[:_NAMES_SHOWN])
            if len(names) > _NAMES_SHOWN:
                shown += f", ... ({len(names)} tensors)"
            console.print(f"  {group}: {info['num_params']:,} ({shown or 'none'})")
        if "units" in model:
            console.print(f"  units: {model['units']['count']}, largest {model['units']['largest_numel']:,} elements")
        if "fp8" in model:
            fp8_table = Table(title="FP8: which Linear layers compute in fp8 (zeroshard.fp8)")
            for column in ("module", "in x out", "compute", "why"):
                fp8_table.add_column(column)
            for row in model["fp8"]:
                fp8_table.add_row(row["module"], f"{row['in_features']} x {row['out_features']}",
                                  "fp8" if row["fp8"] else "bf16", row["why"])
            console.print(fp8_table)
        if "muon" in model:
            muon_table = Table(title="Muon: which optimizer each parameter gets")
            muon_table.add_column("parameter")
            muon_table.add_column("optimizer")
            muon_table.add_column("why")
            for name, reason in model["muon"]["reasons"].items():
                kind = "Muon" if name in model["muon"]["muon"] else "AdamW"
                muon_table.add_row(name, kind, reason)
            console.print(muon_table)
            _print_muon_groups(console, model["muon"]["groups"])
    moe = data.get("moe")
    if moe:
        console.print(f"dense parameters: sharded over ranks {moe['dense_sharded_over']}")
        for g in moe["expert_groups"]:
            console.print(
                f"experts, ep_size {g['ep_size']} ({g['layers']} layer(s), {g['local_experts_per_layer']} of "
                f"{g['experts_per_layer']} experts per rank): tokens exchanged within {g['expert_parallel_groups']}, "
                f"expert parameters sharded over {g['expert_data_parallel_groups']}"
            )

    autoep = data.get("autoep")
    if autoep:
        layers = "" if autoep["layers"] is None else f": {len(autoep['layers'])} MoE layer(s) swapped"
        console.print(f"\nAutoEP (expert_parallel), autoep_size {autoep['autoep_size']}{layers}")
        for line in autoep["settings"]:
            console.print(f"  {line}", soft_wrap=True)

    tensor = data.get("tensor_parallel")
    if tensor:
        _print_tensor_parallel(console, tensor)

    parallel = data.get("parallel")
    if parallel and parallel["sequence_parallel_size"] > 1:
        sp, dp = parallel["sequence_parallel_size"], parallel["data_parallel_size"]
        console.print(
            f"\nsequence parallelism (Ulysses): {dp} data x {sp} sequence ranks; sequence groups "
            f"{parallel['sequence_groups']} (consecutive: two all-to-alls per attention layer), data groups "
            f"{parallel['data_groups']}; dense parameters sharded over all {parallel['dense_sharded_over']} ranks"
        )
        attention = parallel.get("attention")
        if attention is None or max(attention["query_heads_per_rank"]) * sp == attention["heads"]:
            console.print(
                f"  activations per rank: 1/{sp} of a sequence's (each rank holds 1/{sp} of every sequence; attention "
                f"holds the whole sequence for 1/{sp} of the heads), so a {sp}x longer sequence fits the same memory"
            )
        else:
            counts = attention["query_heads_per_rank"]
            console.print(
                f"  activations per rank: 1/{sp} of a sequence's outside attention; attention holds the whole sequence "
                f"for {', '.join(map(str, counts))} of the {attention['heads']} heads on the sequence ranks in turn "
                f"({sp} does not divide them: split by key/value group, {attention['kv_heads']} groups), so the "
                f"busiest rank holds {max(counts)}/{attention['heads']} = {attention['busiest_fraction']:.3f} of a "
                "sequence's attention inputs"
            )

    memory = data["memory"]
    estimate = memory["estimate"]
    if estimate is None:
        console.print("\nmodel-state bytes per parameter on each rank (P parameters, W ranks):")
        for group, coeff in memory["bytes_per_param"].items():
            console.print(f"  {group}: {coeff['replicated']} * P + {coeff['sharded']} * P / W")
        console.print("  (give --model or --params for a full estimate with buffers)")
    else:
        mem = Table(title=f"Per-rank memory estimate ({estimate['num_params']:,} params, W={estimate['world_size']})")
        mem.add_column("component")
        mem.add_column("lives on")
        mem.add_column("bytes", justify="right")
        placement = estimate["placement"]
        for key, value in estimate["model_states"].items():
            mem.add_row(key, placement[key], _human(value))
        mem.add_row("[bold]model states[/bold]", "", f"[bold]{_human(estimate['model_state_bytes'])}[/bold]")
        for key, value in estimate["buffers"].items():
            if value:
                mem.add_row(f"{key} (bound)", "device", _human(value))
        pinned = " (pinned)" if estimate["pinned"] else ""
        for key, value in estimate["host_buffers"].items():
            mem.add_row(f"{key}{pinned}", "host", _human(value))
        mem.add_row("[bold]device total[/bold]", "device", f"[bold]{_human(estimate['device_bytes'])}[/bold]")
        mem.add_row("[bold]host total[/bold]", "host", f"[bold]{_human(estimate['host_bytes'])}[/bold]")
        console.print(mem)
        for assumption in estimate["assumptions"]:
            console.print(f"assumed: {assumption}")
    if memory.get("device_peak_bytes") is not None:
        print_memory_plan(console, data)

    console.print("\ndefaults applied: " + (", ".join(data["defaults_applied"]) or "none"))
    console.print("accepted, no effect: " + (", ".join(data["no_effect_keys"]) or "none"))
    console.print("monitors: " + ("; ".join(data.get("monitors", [])) or "none"))
    for line in _checkpointing_lines(data["checkpointing"]):
        console.print(line, highlight=False, soft_wrap=True)
    console.print(_hang_line(data["hangs"]), highlight=False, soft_wrap=True)


def explain_text(config: Any, world_size: int = 1, model: str | None = None, params: int | None = None,
                 **kwargs: Any) -> str:
    """`print_tables(explain_data(...))` as a string (no terminal colour codes)."""
    out = io.StringIO()
    print_tables(explain_data(config, world_size, model, params, **kwargs), file=out)
    return out.getvalue()
