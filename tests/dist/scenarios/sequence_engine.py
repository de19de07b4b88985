"""Rank-side scenarios for tests/dist/sequence/test_sequence_engine.py: a tiny Llama trained through
ALST and the engine with sequence parallelism, against plain PyTorch on the same global batch.

Reference (every rank computes it, single process, fp32): the model on each data-parallel
group's whole samples, loss = mean over that group's counted tokens, averaged over the groups
(data parallelism's semantics), torch.optim.SGD (momentum). The engine run: each sequence rank gets its
slice of its group's samples, `token_weighted_loss` over the sequence group, `engine.backward`,
`engine.step`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import zeroshard
from tests.dist.scenarios.sequence_hf import VOCAB, tiny_llama
from zeroshard.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
from zeroshard.sequence.loss import token_weighted_loss

# SGD with momentum, not Adam: Adam's first updates are about lr * sign(gradient), so for the
# many elements whose gradient is near zero (~1e-9) the last-bit differences of summing over
# slices flip whole updates, and a parameter comparison would measure noise. SGD keeps a
# gradient difference a gradient difference (times lr).
# Clipping is active (the global norm is about 2): it checks the norm over data x sequence shards.
LR, MOMENTUM, WEIGHT_DECAY, CLIP, STEPS, MICRO, SEQ_PER_RANK = 0.5, 0.9, 0.01, 1.0, 2, 2, 4


def _group_batch(step: int, group: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Data group `group`'s samples at `step`: ids and next-token labels with ignored prompts
    of different lengths, so the sequence slices count different numbers of tokens."""
    gen = torch.Generator().manual_seed(1000 * step + group)
    ids = torch.randint(0, VOCAB, (MICRO, seq), generator=gen)
    shift_labels = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:].clone()
    shift_labels[0, : seq // 2 + 1] = -100
    shift_labels[1, :1] = -100
    return ids, shift_labels


def _token_sum(logits: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), shift_labels.reshape(-1), ignore_index=-100, reduction="sum"
    )


def _config(stage: int) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "SGD", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY, "momentum": MOMENTUM}},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": CLIP,
        "steps_per_print": 1000,
    }
    if stage == 3:
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    return config


def reference(sp: int, steps: int = STEPS) -> dict[str, Any]:
    data_groups, seq = dist.get_world_size() // sp, SEQ_PER_RANK * sp
    model = tiny_llama("sdpa")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    positions = torch.arange(seq).expand(MICRO, seq)
    losses, first_grads = [], None
    for step in range(steps):
        group_means = []
        for group in range(data_groups):
            ids, shift_labels = _group_batch(step, group, seq)
            logits = model(input_ids=ids, position_ids=positions).logits
            group_means.append(_token_sum(logits, shift_labels) / (shift_labels != -100).sum())
        loss = torch.stack(group_means).mean()
        loss.backward()
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append([m.item() for m in group_means])
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params, "grads": first_grads}


def train(stages: list[int], sp: int, steps: int = STEPS, via: str = "mpu") -> list[dict[str, Any]]:
    """For each ZeRO stage: this rank's losses per step and the full parameters after STEPS.

    `via`: where the sequence-parallel groups come from: "mpu" (`initialize(..., mpu=)`),
    "config" (the config's `sequence_parallel_size` and `data_parallel_size`) or "mesh"
    (`initialize(..., mesh_param=(dp, sp))`, DeepSpeed's way)."""
    results = []
    ref = reference(sp, steps)
    for stage in stages:
        model = tiny_llama("sdpa")
        mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, MICRO)
        try:
            if via == "config":
                config = {**_config(stage), "sequence_parallel_size": sp,
                          "data_parallel_size": dist.get_world_size() // sp}
                engine, *_ = zeroshard.initialize(model=model, config=config)
            elif via == "mesh":
                mesh = (dist.get_world_size() // sp, sp)
                engine, *_ = zeroshard.initialize(model=model, config=_config(stage), mesh_param=mesh)
            else:
                engine, *_ = zeroshard.initialize(model=model, config=_config(stage), mpu=mpu)
            sp_rank, group = mpu.get_sequence_parallel_rank(), mpu.get_data_parallel_rank()
            seq = SEQ_PER_RANK * sp
            mine = slice(sp_rank * SEQ_PER_RANK, (sp_rank + 1) * SEQ_PER_RANK)
            positions = torch.arange(seq).expand(MICRO, seq)
            losses = []
            for step in range(steps):
                ids, shift_labels = _group_batch(step, group, seq)
                logits = engine(input_ids=ids[:, mine], position_ids=positions[:, mine]).logits
                counted = (shift_labels[:, mine] != -100).sum()
                loss = token_weighted_loss(
                    _token_sum(logits, shift_labels[:, mine]), counted, engine.seq_parallel_group
                )
                engine.backward(loss)
                if step == 0:
                    grads = {n: zeroshard.safe_get_full_grad(p) for n, p in engine.module.named_parameters()}
                engine.step()
                losses.append(loss.item())
            params = {n: zeroshard.safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()}
            groups = (dist.get_process_group_ranks(engine.seq_parallel_group),
                      dist.get_process_group_ranks(engine.data_parallel_group))
        finally:
            UlyssesSPAttentionHF.unregister_from_transformers()
        results.append({"stage": stage, "losses": losses, "params": params, "groups": groups, "grads": grads,
                        "ref_grads": ref["grads"],
                        "ref_losses": [step[group] for step in ref["losses"]], "ref_params": ref["params"]})
    return results


def _one_step(engine, sp: int) -> None:
    """One training step on group 0's first batch, with or without sequence parallelism."""
    seq = SEQ_PER_RANK * 2
    ids, shift_labels = _group_batch(0, 0, seq)
    positions = torch.arange(seq).expand(MICRO, seq)
    if sp > 1:
        rank = dist.get_rank() % sp
        mine = slice(rank * SEQ_PER_RANK, (rank + 1) * SEQ_PER_RANK)
        ids, shift_labels, positions = ids[:, mine], shift_labels[:, mine], positions[:, mine]
    logits = engine(input_ids=ids, position_ids=positions).logits
    loss_sum = _token_sum(logits, shift_labels)
    group = engine.seq_parallel_group if sp > 1 else dist.group.WORLD
    engine.backward(token_weighted_loss(loss_sum, (shift_labels != -100).sum(), group))
    engine.step()


def _engine(stage: int, sp: int):
    model = tiny_llama("sdpa")
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, MICRO) if sp > 1 else None
    engine, *_ = zeroshard.initialize(model=model, config=_config(stage), mpu=mpu)
    return engine


def _state(engine) -> dict[str, Any]:
    return {
        "params": {n: zeroshard.safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()},
        "momentum": {n: zeroshard.safe_get_full_optimizer_state(p, "momentum_buffer")
                     for n, p in engine.module.named_parameters()},
    }


def cross_checkpoint(stage: int, save_sp: int, load_sp: int, directory: str) -> dict[str, Any]:
    """Save after one step with sequence-parallel size `save_sp`, load into a fresh engine with
    `load_sp`: the loaded parameters and optimizer state, and the saved ones."""
    engine = _engine(stage, save_sp)
    try:
        _one_step(engine, save_sp)
        engine.save_checkpoint(directory, tag="step1")
        saved = _state(engine)
    finally:
        if save_sp > 1:
            UlyssesSPAttentionHF.unregister_from_transformers()
    fresh = _engine(stage, load_sp)
    try:
        fresh.load_checkpoint(directory, tag="step1")
        loaded = _state(fresh)
    finally:
        if load_sp > 1:
            UlyssesSPAttentionHF.unregister_from_transformers()
    return {"saved": saved, "loaded": loaded}
