"""Rank-side scenarios for tests/dist/engine/test_compile.py: the engine compiled with
`backend="aot_eager"` against the same engine eager, on the same data.

aot_eager traces each unit (dynamo), splits forward and backward (AOTAutograd) and runs the
graphs' aten ops with the eager kernels, so every difference from eager would be zeroshard's:
the reference is the eager engine of the same case, and equality is bitwise. Graph counts are
dynamo's own (`counters["stats"]["unique_graphs"]`: graphs compiled so far in the process).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

from tests.dist.scenarios.common import Case, build_engine, case_batches, engine_loop_step, train

BACKEND = "aot_eager"


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _compiled(case: Case, model: torch.nn.Module | None = None):
    engine = build_engine(case, model)
    engine.compile(backend=BACKEND)
    return engine


def _same(eager: dict[str, Any], compiled: dict[str, Any]) -> dict[str, Any]:
    """Bitwise comparison of two `train` results: losses, norms and every step's masters."""
    masters = [
        name for step, (a, b) in enumerate(zip(eager["master"], compiled["master"], strict=True))
        for name in a if not torch.equal(a[name], b[name]) and (step, name)
    ]
    return {"losses": eager["losses"] == compiled["losses"],
            "norms": eager["grad_norms"] == compiled["grad_norms"], "masters_differing": masters[:5]}


def _regions(engine) -> list[dict[str, Any]]:
    return [{"name": r.name, "fullgraph": r.fullgraph, "eager_parts": r.eager_parts, "graph_break": r.graph_break}
            for r in engine.compiled_regions]


def bitwise_matrix(steps: int) -> dict[str, Any]:
    """Stages 0-3 x fp32/bf16: eager and compiled, `steps` steps each; and how many graphs each
    compiled run made after its first step (none: no recompilation), and in all."""
    out: dict[str, Any] = {"cases": {}, "graphs_before": _graphs()}
    for mode in ("fp32", "bf16"):
        for stage in (0, 1, 2, 3):
            case = Case(stage=stage, mode=mode, steps=steps, keep=("master",))
            eager = train(build_engine(case), case)
            engine = _compiled(case)
            after_step: list[int] = []

            def step_fn(engine, case, batch, after_step=after_step):
                losses = engine_loop_step(engine, case, batch)
                after_step.append(_graphs())
                return losses

            compiled = train(engine, case, step_fn)
            out["cases"][case.label] = {**_same(eager, compiled), "graphs_after_step": after_step,
                                        "regions": _regions(engine), "is_compiled": engine.is_compiled}
    out["graphs_after"] = _graphs()
    return out


def resume(stage: int, mode: str, steps: int, directory: str) -> dict[str, Any]:
    """A compiled run saves after half its steps; a new compiled engine loads that and trains the
    rest: its masters against the uninterrupted compiled run's, and the eager run's."""
    case = Case(stage=stage, mode=mode, steps=steps, keep=("master",))
    batches = case_batches(case)
    half = steps // 2
    whole_engine = _compiled(case)
    first = train(whole_engine, case, batches=batches[:half])
    whole_engine.save_checkpoint(directory, tag="half")
    rest = train(whole_engine, case, batches=batches[half:])
    resumed_engine = _compiled(case)
    resumed_engine.load_checkpoint(directory, tag="half")
    resumed = train(resumed_engine, case, batches=batches[half:])
    eager = train(build_engine(case), case, batches=batches)
    return {
        "resumed_equals_whole": _same(rest, resumed),
        "whole_equals_eager": _same(eager, {key: first[key] + rest[key] for key in ("losses", "grad_norms", "master")}),
        "global_steps": resumed_engine.global_steps,
    }


def shape_change() -> dict[str, Any]:
    """Graphs made by a smaller batch (the last of an epoch) and by full batches after it, from
    empty caches (dynamo remembers, per code object, which sizes it saw change)."""
    torch._dynamo.reset()
    case = Case(stage=2, mode="fp32", micro=4, steps=1, keep=())
    engine = _compiled(case)
    tokens, targets = case_batches(case)[0]
    rank = dist.get_rank()
    full = (tokens[rank * 4:(rank + 1) * 4], targets[rank * 4:(rank + 1) * 4])

    def step(rows: int) -> int:
        before = _graphs()
        engine.backward(engine(full[0][:rows], full[1][:rows]))
        engine.step()
        return _graphs() - before

    return {"full": [step(4) for _ in range(3)], "smaller": step(3), "full_again": [step(4) for _ in range(2)],
            "smaller_again": step(3), "other_size": step(2)}


# Feature cases: every mode family, accumulation, checkpointing, offload, Muon (compiled
# Newton-Schulz). Three steps each, bitwise vs eager.
_OFFLOAD = {"zero_optimization": {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}}
FEATURE_CASES = [
    Case(stage=2, mode="fp32", ga=4, steps=3, keep=("master",), variant="accumulation"),
    Case(stage=3, mode="fp16", steps=3, keep=("master",)),
    Case(stage=1, mode="autocast_bf16", steps=3, keep=("master",)),
    Case(stage=3, mode="fp32", steps=3, keep=("master",), model_kwargs={"checkpointing": "reentrant"},
         variant="reentrant"),
    Case(stage=0, mode="fp32", steps=3, keep=("master",), model_kwargs={"checkpointing": "non_reentrant"},
         variant="non-reentrant"),
    Case(stage=3, mode="fp32", steps=3, keep=("master",), extra=_OFFLOAD, variant="offload"),
    Case(stage=2, mode="fp32", steps=3, keep=("master",),
         extra={"optimizer": {"type": "Muon", "params": {"lr": 0.02}}}, variant="muon"),
]


def features() -> dict[str, Any]:
    out = {}
    for case in FEATURE_CASES:
        eager = train(build_engine(case), case)
        engine = _compiled(case)
        out[case.label] = {**_same(eager, train(engine, case)), "regions": _regions(engine),
                           "ns_compiled": "orthogonalize" in vars(engine.optimizer)}
    return out


def moe_gpt(stage: int, steps: int = 3) -> dict[str, Any]:
    """The demo GPT with an MoE layer in each block, experts over 2 ranks (ep_size 2): eager
    against compiled, every rank drawing the same gate noise (seeded before each step)."""
    import zeroshard
    from zeroshard.models import build_gpt

    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
              "steps_per_print": 1000}

    def run(compiled: bool):
        torch.manual_seed(0)
        model = build_gpt("tiny", n_layer=2, n_embd=32, block_size=16, moe_num_experts=2, moe_ep_size=2)
        engine, *_ = zeroshard.initialize(model=model, config=copy.deepcopy(config))
        if compiled:
            engine.compile(backend=BACKEND)
        losses = []
        for step in range(steps):
            idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
            torch.manual_seed(step)
            _, loss = engine(idx, idx)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        masters = {n: zeroshard.safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()}
        return losses, masters, engine

    eager_losses, eager_masters, _ = run(False)
    losses, masters, engine = run(True)
    return {"losses": losses == eager_losses, "masters_differing": [n for n in masters
                                                                    if not torch.equal(masters[n], eager_masters[n])],
            "regions": _regions(engine)}


def autoep(stage: int, non_moe: bool, steps: int = 1) -> dict[str, Any]:
    """A tiny Mixtral with AutoEP over 2 ranks, eager against compiled (compile.autoep_non_moe:
    DeepSpeed's choice of regions, the AutoEP layers' parents)."""
    import zeroshard
    from tests.dist.scenarios import autoep as scenario

    def run(compiled: bool):
        config = scenario.engine_config(2, stage, "fp32")
        if non_moe:
            config["compile"] = {"autoep_non_moe": True}
        model = scenario.build_hf("mixtral")
        model.config.use_cache = False
        model.config.output_router_logits = False  # Hugging Face records them with hooks dynamo cannot trace
        engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
        if compiled:
            engine.compile(backend=BACKEND)
        losses = []
        for step in range(steps):
            for micro in range(scenario.GA):
                x = scenario.batch(dist.get_rank(), step, micro)
                loss = engine(input_ids=x, labels=x).loss
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
        return losses, scenario.by_global_name(engine, zeroshard.safe_get_full_fp32_param), engine

    eager_losses, eager_masters, _ = run(False)
    losses, masters, engine = run(True)
    return {"losses": losses == eager_losses,
            "masters_differing": [n for n in masters if not torch.equal(masters[n], eager_masters[n])],
            "regions": _regions(engine)}


def sequence(stage: int, steps: int = 2) -> dict[str, Any]:
    """A tiny Llama under Ulysses (ALST, sequence-parallel size 2), eager against compiled: the
    losses, and the largest relative differences of the first step's gradients and of the final
    masters (the unit breaks at the attention: see test_compile.py for why not bitwise)."""
    import zeroshard
    from tests.dist.scenarios.sequence_engine import MICRO, SEQ_PER_RANK, _config, _group_batch, _token_sum
    from tests.dist.scenarios.sequence_hf import tiny_llama
    from zeroshard.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from zeroshard.sequence.loss import token_weighted_loss

    def run(compiled: bool):
        model = tiny_llama("sdpa")
        model.config.use_cache = False
        mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, MICRO)
        try:
            engine, *_ = zeroshard.initialize(model=model, config=_config(stage), mpu=mpu)
            if compiled:
                engine.compile(backend=BACKEND)
            seq = 2 * SEQ_PER_RANK
            mine = slice(dist.get_rank() * SEQ_PER_RANK, (dist.get_rank() + 1) * SEQ_PER_RANK)
            positions = torch.arange(seq).expand(MICRO, seq)
            losses, grads = [], None
            for step in range(steps):
                ids, labels = _group_batch(step, 0, seq)
                logits = engine(input_ids=ids[:, mine], position_ids=positions[:, mine]).logits
                counted = (labels[:, mine] != -100).sum()
                loss = token_weighted_loss(_token_sum(logits, labels[:, mine]), counted, engine.seq_parallel_group)
                engine.backward(loss)
                if grads is None:
                    grads = {n: zeroshard.safe_get_full_grad(p) for n, p in engine.module.named_parameters()}
                engine.step()
                losses.append(loss.item())
            masters = {n: zeroshard.safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()}
            return losses, grads, masters, engine
        finally:
            UlyssesSPAttentionHF.unregister_from_transformers()

    def largest(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
        return max(float((a[n] - b[n]).abs().max() / b[n].abs().max()) for n in b)

    eager_losses, eager_grads, eager_masters, _ = run(False)
    losses, grads, masters, engine = run(True)
    return {"first_loss_equal": losses[0] == eager_losses[0],
            "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, eager_losses, strict=True)),
            "grad_rel": largest(grads, eager_grads), "master_rel": largest(masters, eager_masters),
            "regions": _regions(engine)}
