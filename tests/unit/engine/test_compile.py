"""engine.compile() and the per-module compile under it, in one process (docs/compile.md).

Graph counts use dynamo's own counters (`torch._dynamo.utils.counters`: "stats"/"unique_graphs"
is the number of graphs compiled, "graph_break" the breaks by reason) with the "eager" backend:
dynamo traces and guards exactly as for inductor, without generating code, so a count here is
the count any backend gets. The multi-process equality with eager (stages 0-3, aot_eager) is
tests/dist/engine/test_compile.py.
"""

from __future__ import annotations

import copy
import logging
import pickle

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import zeroshard
from zeroshard.engine.compiled_forward import CompiledForward, compile_forward, eager_parts
from zeroshard.models import build_gpt
from zeroshard.moe.layer import MoE
from zeroshard.optim.muon.newton_schulz import compiled_orthogonalize, orthogonalize


def _config(stage: int, **extra) -> dict:
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
              "steps_per_print": 1000}
    config.update(extra)
    return config


def _gpt_engine(stage: int = 3, **extra):
    torch.manual_seed(0)
    model = build_gpt("tiny", n_layer=2, n_embd=32, block_size=16)
    engine, *_ = zeroshard.initialize(model=model, config=_config(stage, **extra), dist_init_required=False)
    return engine


def _step(engine, seed: int = 0) -> float:
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(seed))
    _, loss = engine(idx, idx)
    engine.backward(loss)
    engine.step()
    return loss.item()


def _graphs_and_breaks() -> tuple[int, int]:
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches and counters emptied: each test's classes compile from scratch."""
    torch._dynamo.reset()
    counters.clear()
    yield
    counters.clear()


# ------------------------------------------------------------------ the engine's API


def test_compile_refuses_what_it_cannot_do_with_the_reason():
    engine = _gpt_engine(stage=3)
    with pytest.raises(ValueError, match=r"schedule=.*a DeepCompile schedule.*Call compile\(\) without schedule"):
        engine.compile(schedule=[(0, [])])
    with pytest.raises(ValueError, match=r"compiled_autograd_enabled=True\): zeroshard reduces gradients from hooks"):
        engine.compile(compiled_autograd_enabled=True)
    with pytest.raises(ValueError, match=r"'fullgrph' is not a torch.compile argument\. Use fullgraph, dynamic"):
        engine.compile(compile_kwargs={"fullgrph": True})
    with pytest.raises(ValueError, match=r"CUDA graphs replay the addresses.*ZeRO stage 3 frees"):
        engine.compile(compile_kwargs={"mode": "reduce-overhead"})
    engine.compile(compile_kwargs={"disable": True})  # torch.compile's own switch: nothing compiled
    assert engine.is_compiled is False and engine.compiled_regions == []


def test_inductor_rounds_low_precision_as_eager_does():
    # bf16: emulate_precision_casts on (docs/compile.md), a mode turned into its options (torch.compile
    # takes one or the other); nothing is traced here, the settings are what is checked.
    engine = _gpt_engine(stage=1, bf16={"enabled": True})
    engine.compile(backend="inductor", compile_kwargs={"mode": "max-autotune-no-cudagraphs"})
    options = engine.module.blocks[0].forward.compilation.options
    assert "mode" not in options and options["options"]["emulate_precision_casts"] is True
    assert options["options"]["max_autotune"] is True
    fp32 = _gpt_engine(stage=1)
    fp32.compile(backend="inductor", compile_kwargs={"mode": "max-autotune-no-cudagraphs"})
    assert fp32.module.blocks[0].forward.compilation.options == {"mode": "max-autotune-no-cudagraphs"}
    opted_out = _gpt_engine(stage=1, bf16={"enabled": True})
    opted_out.compile(backend="inductor", compile_kwargs={"options": {"emulate_precision_casts": False}})
    assert opted_out.module.blocks[0].forward.compilation.options == {"options": {"emulate_precision_casts": False}}


def test_autoep_non_moe_needs_autoep_layers():
    engine = _gpt_engine(stage=1, compile={"autoep_non_moe": True})
    with pytest.raises(ValueError, match=r"^compile.autoep_non_moe=true: compiles the modules around AutoEP layers, "
                                         r"and the model has none\. Enable AutoEP"):
        engine.compile(backend="eager")
    with pytest.raises(ValueError, match=r"compile.autoep_non_moe=true runs the AutoEP layers eagerly"):
        engine.compile(backend="eager", compile_kwargs={"fullgraph": True})


def test_compile_compiles_each_block_and_is_compiled_tells_the_truth(fresh_dynamo, caplog):
    engine, eager = _gpt_engine(stage=3), _gpt_engine(stage=3)
    assert engine.is_compiled is False
    with caplog.at_level(logging.WARNING, logger="zeroshard"):
        engine.compile(backend="eager", compile_kwargs={"backend": "inductor"})  # DeepSpeed: the argument wins
        engine.compile(backend="eager")  # a second call changes nothing
    assert any("backend` in compile_kwargs is overridden" in r.getMessage() for r in caplog.records)
    assert engine.is_compiled is True
    assert [r.name for r in engine.compiled_regions] == ["blocks.0", "blocks.1"]
    assert all(isinstance(engine.module.blocks[i].__dict__["forward"], CompiledForward) for i in range(2))
    losses = [_step(engine, s) for s in range(3)]
    assert losses == [_step(eager, s) for s in range(3)]  # "eager" backend: the same ops, the same bits
    # One graph for both blocks (stage 3's hooks on their submodules read one flag), no break.
    assert _graphs_and_breaks() == (1, 0)
    assert all(r.fullgraph and r.graph_break is None and not r.eager_parts for r in engine.compiled_regions)
    # state-dict names are the model's own (the modules stay where they are)
    assert "blocks.0.attn.c_attn.weight" in dict(engine.module.named_parameters())


def test_blocks_compiled_by_the_user_count_and_are_left_alone(fresh_dynamo):
    torch.manual_seed(0)
    model = build_gpt("tiny", n_layer=2, n_embd=32, block_size=16)
    for i, block in enumerate(model.blocks):  # torchtitan's recipe, before initialize
        model.blocks[i] = torch.compile(block, backend="eager")
    engine, *_ = zeroshard.initialize(model=model, config=_config(2), dist_init_required=False)
    assert engine.is_compiled is True  # without engine.compile(): the blocks run compiled code
    engine.compile(backend="eager")
    assert engine.compiled_regions == []  # nothing left to compile
    assert not isinstance(vars(engine.module.blocks[0]).get("forward"), CompiledForward)


def test_blocks_compiled_with_module_compile_run_the_engines_hooks_eagerly(fresh_dynamo):
    # Accelerate's regional compilation calls block.compile(): the compiled _call_impl holds the
    # engine's stage-3 hooks, which run eagerly (graph breaks around them), so the step is right.
    engine, eager = _gpt_engine(stage=3), _gpt_engine(stage=3)
    for block in engine.module.blocks:
        block.compile(backend="eager")
    assert engine.is_compiled is True
    assert _step(engine) == _step(eager)
    reasons = list(counters["graph_break"])
    assert reasons and all("an engine hook" in r or "marked as skipped" in r for r in reasons), reasons


def test_copies_of_a_compiled_module_run_eagerly():
    torch.manual_seed(0)
    block = build_gpt("tiny", n_layer=1, n_embd=32, block_size=16).blocks[0]
    compiled = compile_forward(block, backend="eager")
    twin = copy.deepcopy(block)
    assert twin.forward.__func__ is type(block).forward and twin.forward.__self__ is twin
    loaded = pickle.loads(pickle.dumps(block))
    assert loaded.forward.__func__ is type(block).forward and loaded.forward.__self__ is loaded
    assert block.forward is compiled  # the original keeps its compiled forward


class _Breaks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        torch._dynamo.graph_break()  # stands for any code dynamo cannot trace
        return torch.tanh(y)


def test_a_unit_that_breaks_is_compiled_with_breaks_and_says_where(fresh_dynamo, caplog):
    torch.manual_seed(0)
    module, x = _Breaks(), torch.randn(2, 4)
    want = module(x)
    compile_forward(module, backend="eager")
    with caplog.at_level(logging.WARNING, logger="zeroshard"):
        got = module(x)
    assert torch.equal(got, want)
    assert module.forward.fullgraph is False and "graph_break" in module.forward.graph_break
    assert any("does not compile as one graph" in r.getMessage() for r in caplog.records)
    torch._dynamo.reset()  # dynamo's cache is per code object: `_Breaks.forward` compiled with breaks above
    strict = _Breaks()
    compile_forward(strict, backend="eager", fullgraph=True)  # the caller's fullgraph=True: a break is an error
    with pytest.raises(torch._dynamo.exc.Unsupported):
        strict(x)


class _Scaled(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = str(scale)  # a string: dynamo guards on its value, one graph per module

    def forward(self, x):
        return x * float(self.scale)


def test_past_dynamos_recompile_limit_the_rest_runs_eagerly_instead_of_failing(fresh_dynamo):
    # One graph per module (a Hugging Face KV cache does this per layer): with fullgraph=True
    # dynamo would raise at the limit; a unit compiled without the caller's fullgraph goes on.
    modules = [_Scaled(float(i)) for i in range(torch._dynamo.config.recompile_limit + 2)]
    shared: dict = {}
    for m in modules:
        compile_forward(m, backend="eager", shared=shared)
    x = torch.ones(2)
    assert [float(m(x)[0]) for m in modules] == [float(i) for i in range(len(modules))]
    assert modules[0].forward.fullgraph is False
    assert "recompile limit" in modules[0].forward.graph_break


# ------------------------------------------------------------- graph breaks by model


def test_an_moe_block_breaks_exactly_at_the_moe_layer(fresh_dynamo):
    torch.manual_seed(0)
    model = build_gpt("tiny", n_layer=2, n_embd=32, block_size=16, moe_num_experts=2)
    reference = copy.deepcopy(model)
    idx = torch.randint(0, 256, (2, 16))
    shared: dict = {}
    for i, block in enumerate(model.blocks):
        assert list(eager_parts(block)) == ["mlp"] and isinstance(block.mlp, MoE)
        compile_forward(block, backend="eager", label=f"blocks.{i}", shared=shared)
    torch.manual_seed(1)  # the gate draws random numbers (DeepSpeed's random token selection)
    _, loss = model(idx, idx)
    torch.manual_seed(1)
    _, want = reference(idx, idx)
    assert torch.equal(loss, want)
    assert all(b.forward.fullgraph is False and b.forward.graph_break is None for b in model.blocks)
    reasons = list(counters["graph_break"])
    assert reasons and all("zeroshard: the MoE layer" in r for r in reasons), reasons
    # Two graphs, before and after the MoE layer, which both blocks share (no recompile).
    assert counters["stats"]["unique_graphs"] == 2


def _tiny_hf(kind: str) -> nn.Module:
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32, use_cache=False)
    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**common))
    if kind == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**common, head_dim=8))
    return MixtralForCausalLM(MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2))


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mixtral"])
def test_hugging_face_decoder_layers_compile_as_one_graph(kind, fresh_dynamo):
    # Through the engine at stage 3 (its hooks on every layer's submodules), fullgraph=True: a
    # break would raise. The reference is the Hugging Face model itself, eager.
    reference = _tiny_hf(kind)
    model = copy.deepcopy(reference)
    engine, *_ = zeroshard.initialize(model=model, config=_config(3), dist_init_required=False)
    engine.compile(backend="eager", compile_kwargs={"fullgraph": True})
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    grads = {n: zeroshard.safe_get_full_grad(p) for n, p in engine.module.named_parameters()}
    want = reference(input_ids=ids, labels=ids).loss
    want.backward()
    assert torch.equal(loss, want)
    assert all(torch.equal(grads[n], p.grad) for n, p in reference.named_parameters())
    assert [r.name for r in engine.compiled_regions] == ["model.layers.0", "model.layers.1"]
    assert _graphs_and_breaks() == (1, 0)  # one graph for every layer, no break


# ------------------------------------------------------------------------- Muon


@pytest.mark.parametrize("method, shape", [("gram", (3, 8, 32)), ("standard", (2, 16, 16))])
def test_compiled_newton_schulz_equals_eager(method, shape, fresh_dynamo):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    want = orthogonalize(x, 5, method, torch.float32)
    got = compiled_orthogonalize("aot_eager")(x, 5, method, torch.float32)
    # aot_eager runs the traced graph's aten ops, the same kernels as eager: the same bits.
    # (inductor fuses and reorders: benchmarks/compile_conformance.py compares it within 1e-5.)
    assert torch.equal(got, want)
    assert _graphs_and_breaks() == (1, 0)


def test_engine_compile_compiles_muons_newton_schulz():
    torch.manual_seed(0)
    model = build_gpt("tiny", n_layer=1, n_embd=32, block_size=16)
    config = _config(1, optimizer={"type": "Muon", "params": {"lr": 0.02}})
    engine, *_ = zeroshard.initialize(model=model, config=config, dist_init_required=False)
    assert "orthogonalize" not in vars(engine.optimizer)  # eager: the class's
    engine.compile(backend="eager")
    compiled = vars(engine.optimizer)["orthogonalize"]
    assert compiled.func is orthogonalize
    iterations = compiled.keywords["iterations"]
    assert all(hasattr(f, "_torchdynamo_orig_callable") for f in (iterations.standard, iterations.gram))
