"""Muon, one process: config keys and defaults, which parameters get Muon, the update
against a formula-level float64 reference, and the sharded optimizer on a 1-rank engine."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zeroshard
from zeroshard.optim.muon.optimizer import (
    Muon,
    ShardedMuon,
    assign_owners,
    classify_parameter,
    matrix_layout,
    muon_param_plan,
    parse_muon_params,
    split_param_groups,
)

LR, ADAM_LR, MOMENTUM, WD, BETAS, EPS = 0.05, 0.01, 0.9, 0.1, (0.9, 0.95), 1e-8


class Net(nn.Module):
    """An embedding tied to the output head under names without "embed"/"lm_head" (as the
    demo's GPT: wte / head), a separate 'embed_pos', matrices of three aspect ratios, a 3-D
    expert stack, a 4-D conv weight, a 0-d gain and 1-D norms and biases."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(9, 6)
        self.embed_pos = nn.Parameter(torch.randn(4, 6) * 0.1)
        self.up = nn.Linear(6, 12)
        self.down = nn.Linear(12, 6, bias=False)
        self.square = nn.Linear(6, 6)
        self.experts = nn.Parameter(torch.randn(3, 6, 6) * 0.3)
        self.experts.is_expert_group = True  # a stack of expert matrices (DeepSpeed's mark)
        self.conv = nn.Conv2d(1, 2, kernel_size=2)
        self.norm = nn.LayerNorm(6)
        self.gain = nn.Parameter(torch.tensor(1.5))
        self.head = nn.Linear(6, 9, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.wte(x) + self.embed_pos
        h = h + self.down(torch.tanh(self.up(self.norm(h))))
        h = h + torch.tanh(self.square(h)) + torch.einsum("btd,edk->btk", h, self.experts) / 3
        feature = self.conv(h.unsqueeze(1))
        logits = self.head(h) * self.gain
        return F.cross_entropy(logits.reshape(-1, 9), y.reshape(-1)) + 0.1 * feature.pow(2).mean()


MUON_NAMES = {"up.weight", "down.weight", "square.weight", "experts", "conv.weight"}


def batches(steps: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    return [(torch.randint(0, 9, (3, 4), generator=gen), torch.randint(0, 9, (3, 4), generator=gen))
            for _ in range(steps)]


# ----------------------------------------------------------------- config and defaults
def test_defaults_are_deepspeeds_plus_ours():
    s = parse_muon_params({})
    assert (s.muon_lr, s.momentum, s.ns_method, s.weight_decay) == (0.02, 0.95, "gram", 0.0)
    assert (s.adam_lr, s.betas, s.eps) == (3e-4, (0.9, 0.95), 1e-10)
    assert (s.nesterov, s.ns_steps, s.ns_dtype) == (True, 5, "auto")
    assert s.muon_exclude_patterns == ("embed", "lm_head")


def test_lr_sets_both_kinds_and_the_specific_keys_win():
    s = parse_muon_params({"lr": 0.1})
    assert (s.muon_lr, s.adam_lr) == (0.1, 0.1)
    s = parse_muon_params({"lr": 0.1, "muon_lr": 0.03, "adam_lr": 1e-3})
    assert (s.muon_lr, s.adam_lr) == (0.03, 1e-3)


def test_every_bad_key_is_named_at_once():
    with pytest.raises(ValueError) as info:
        parse_muon_params({"momentun": 0.9, "ns_method": "newton", "momentum": 1.0, "ns_steps": 0,
                           "betas": [0.9], "ns_dtype": "fp8", "muon_exclude_patterns": "embed"})
    message = str(info.value)
    for expected in ("optimizer.params.momentun: unknown key", "Did you mean 'momentum'?",
                     "optimizer.params.ns_method='newton'", "optimizer.params.momentum=1.0",
                     "optimizer.params.ns_steps=0", "optimizer.params.betas=[0.9]",
                     "optimizer.params.ns_dtype='fp8'", "optimizer.params.muon_exclude_patterns='embed'"):
        assert expected in message


# -------------------------------------------------------------------- classification
def test_which_parameters_get_muon():
    plan = {c.name: c for c in muon_param_plan(Net())}
    assert {n for n, c in plan.items() if c.use_muon} == MUON_NAMES
    assert plan["wte.weight"].reason == "nn.Embedding weight"  # tied to head: one parameter
    assert "head.weight" not in plan
    assert plan["embed_pos"].reason == "name contains 'embed'"
    assert plan["gain"].reason == "0-D" and plan["norm.weight"].reason == "1-D"
    assert plan["experts"].reason == "3 stacked matrices 6x6"
    assert plan["conv.weight"].reason == "4-D, viewed as 2x4"


def test_exclude_patterns_are_configurable():
    assert not classify_parameter("lm_head.weight", (9, 6)).use_muon
    assert classify_parameter("lm_head.weight", (9, 6), exclude_patterns=()).use_muon
    assert not classify_parameter("blocks.0.attn.weight", (6, 6), exclude_patterns=("attn",)).use_muon


def test_moe_routers_get_adamw_and_gate_projections_muon():
    """Routers are matched as whole name components: DeepSpeed's MoE gate, Hugging Face's
    mlp.gate, AutoEP's router; an MLP's gate_proj and a fused gate_up_proj are matrices."""
    for name in ("layers.0.moe.deepspeed_moe.gate.wg.weight", "model.layers.1.mlp.gate.weight",
                 "layers.0.mlp.router.weight", "layers.0.mlp.router.gate.weight"):
        choice = classify_parameter(name, (8, 16))
        assert not choice.use_muon and choice.reason.startswith("router: name component"), name
    for name, shape in (("model.layers.0.mlp.gate_proj.weight", (16, 8)),
                        ("layers.0.mlp.experts.gate_up_proj", (4, 32, 8)),
                        ("layers.0.mlp.experts.w1", (4, 16, 8)), ("layers.0.mlp.experts.w2", (4, 8, 16)),
                        ("layers.0.gates.weight", (8, 8))):
        assert classify_parameter(name, shape).use_muon, name
    # Configurable: [] gives routers Muon again; other names can be added.
    assert classify_parameter("mlp.gate.weight", (8, 16), exclude_modules=()).use_muon
    assert not classify_parameter("mlp.switch.weight", (8, 16), exclude_modules=("switch",)).use_muon
    assert parse_muon_params({"muon_exclude_modules": ["switch"]}).muon_exclude_modules == ("switch",)
    assert parse_muon_params({}).muon_exclude_modules == ("gate", "router")
    with pytest.raises(ValueError, match=r"optimizer.params.muon_exclude_modules='gate': must be a list"):
        parse_muon_params({"muon_exclude_modules": "gate"})
    with pytest.raises(ValueError, match=r"muon_exclude_modules=\['mlp.gate'\]: must be a list of module names"):
        parse_muon_params({"muon_exclude_modules": ["mlp.gate"]})


def test_use_muon_attribute_overrides_the_name_rules():
    """A parameter's own use_muon attribute (DeepSpeed's tag) wins over names and embeddings,
    in the engine's split, the plan and the single-process Muon; a vector cannot be forced."""
    model = Net()
    params = dict(model.named_parameters())
    params["up.weight"].use_muon = False
    params["embed_pos"].use_muon = True
    plan = {c.name: c for c in muon_param_plan(model)}
    assert plan["up.weight"].reason == "use_muon=False on the parameter" and not plan["up.weight"].use_muon
    assert plan["embed_pos"].use_muon and plan["embed_pos"].reason.endswith("use_muon=True on the parameter")
    hyper, group_of = split_param_groups(model, [{}], {id(p): 0 for p in model.parameters()}, {})
    assert {n for n, p in params.items() if hyper[group_of[id(p)]]["use_muon"]} == (
        MUON_NAMES - {"up.weight"} | {"embed_pos"})
    opt = Muon(model)
    assert {c.name for c in opt.choices if c.use_muon} == MUON_NAMES - {"up.weight"} | {"embed_pos"}
    params["norm.weight"].use_muon = True
    with pytest.raises(ValueError, match=r"'norm.weight' \(shape \(6,\)\) has use_muon=True"):
        muon_param_plan(model)


def test_matrix_layout():
    assert matrix_layout((12, 6)) == (1, 12, 6)
    assert matrix_layout((8, 4, 6), is_expert_group=True) == (8, 4, 6)  # marked experts
    assert matrix_layout((8, 4, 6)) == (1, 8, 24)  # unmarked 3-D (Conv1d): one (out, rest) matrix
    assert matrix_layout((16, 3, 3, 3)) == (1, 16, 27)  # conv: (out, rest)


def test_split_param_groups_keeps_user_keys_and_explicit_groups():
    model = Net()
    params = dict(model.named_parameters())
    hyper = [{"weight_decay": 0.0}, {"use_muon": False, "lr": 1e-4}]
    group_of = {id(p): 0 for p in model.parameters()}
    group_of[id(params["square.weight"])] = 1  # the user wants AdamW here
    new_hyper, new_group_of = split_param_groups(model, hyper, group_of, {"muon_lr": 0.03, "weight_decay": 0.1})
    assert [(g["use_muon"], g["lr"], g["weight_decay"]) for g in new_hyper] == [
        (True, 0.03, 0.0), (False, 3e-4, 0.0), (False, 1e-4, 0.1)]
    assert "betas" not in new_hyper[0] and "momentum" not in new_hyper[1]
    kinds = {name: new_hyper[new_group_of[id(p)]]["use_muon"] for name, p in params.items()}
    assert {n for n, k in kinds.items() if k} == MUON_NAMES - {"square.weight"}
    with pytest.raises(ValueError, match=r"use_muon=True but parameter 'gain' has shape \(\)"):
        split_param_groups(model, [{"use_muon": True}], {id(p): 0 for p in model.parameters()}, {})


def test_owners_are_balanced_and_deterministic():
    costs = [40, 10, 30, 20, 20, 5]
    owners = assign_owners(costs, 2)
    assert owners == assign_owners(costs, 2)
    loads = [sum(c for c, o in zip(costs, owners, strict=True) if o == r) for r in range(2)]
    assert sorted(loads) == [60, 65]
    assert assign_owners([7, 7, 7], 3) == [0, 1, 2]


# ----------------------------------------------------------- the update vs the formula
def reference_ns(g: torch.Tensor) -> torch.Tensor:
    a, b, c = 3.4445, -4.7750, 2.0315
    tall = g.shape[0] > g.shape[1]
    x = g.T if tall else g
    x = x / (torch.linalg.norm(x) + 1e-7)
    for _ in range(5):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if tall else x


def reference_update(u: torch.Tensor) -> torch.Tensor:
    if u.dim() == 3:
        return torch.stack([reference_update(e) for e in u])
    matrix = u.reshape(u.shape[0], -1)
    return (reference_ns(matrix) * math.sqrt(max(1.0, matrix.shape[0] / matrix.shape[1]))).reshape(u.shape)


def reference_train(nesterov: bool) -> dict[str, torch.Tensor]:
    """The issue's formula, float64, written out per parameter."""
    model = Net().double()
    state: dict[str, dict] = {}
    for step, (x, y) in enumerate(batches(), start=1):
        model.zero_grad()
        model(x, y).backward()
        with torch.no_grad():
            for name, p in model.named_parameters():
                g, s = p.grad, state.setdefault(name, {})
                if name in MUON_NAMES:
                    s["m"] = MOMENTUM * s.get("m", torch.zeros_like(p)) + (1 - MOMENTUM) * g
                    u = (1 - MOMENTUM) * g + MOMENTUM * s["m"] if nesterov else s["m"]
                    p.copy_(p * (1 - LR * WD) - LR * reference_update(u))
                else:
                    s["m1"] = BETAS[0] * s.get("m1", torch.zeros_like(p)) + (1 - BETAS[0]) * g
                    s["v"] = BETAS[1] * s.get("v", torch.zeros_like(p)) + (1 - BETAS[1]) * g * g
                    m_hat, v_hat = s["m1"] / (1 - BETAS[0] ** step), s["v"] / (1 - BETAS[1] ** step)
                    p.copy_(p * (1 - ADAM_LR * WD) - ADAM_LR * m_hat / (v_hat.sqrt() + EPS))
    return {n: p.detach() for n, p in model.named_parameters()}


def muon_kwargs(ns_method: str, nesterov: bool) -> dict:
    return {"muon_lr": LR, "adam_lr": ADAM_LR, "momentum": MOMENTUM, "weight_decay": WD, "betas": BETAS,
            "eps": EPS, "ns_method": ns_method, "nesterov": nesterov}


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("ns_method", ["gram", "standard"])
def test_muon_matches_the_formula_in_float64(ns_method, nesterov):
    # Both in float64: what is left is rounding, ~1e-16 per operation; 1e-12 bounds it.
    model = Net().double()
    optimizer = Muon(model, **muon_kwargs(ns_method, nesterov))
    for x, y in batches():
        optimizer.zero_grad()
        model(x, y).backward()
        optimizer.step()
    expected = reference_train(nesterov)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], rtol=0, atol=1e-12, msg=name)


def test_muon_refuses_unnamed_parameters():
    with pytest.raises(ValueError, match="Plain parameters carry no names"):
        Muon(Net().parameters())
    with pytest.raises(ValueError, match="param group 0 has no 'use_muon'"):
        Muon([{"params": list(Net().parameters())}])


# ------------------------------------------------------- ShardedMuon on a 1-rank engine
def _engine(stage: int, groups_fn=None, ns_method: str = "gram"):
    model = Net()
    params_cfg = {**muon_kwargs(ns_method, True), "betas": list(BETAS)}
    if groups_fn is None:
        hyper, group_of = split_param_groups(model, [{}], {id(p): 0 for p in model.parameters()}, params_cfg)
        groups = [dict(h, params=[p for p in model.parameters() if group_of[id(p)] == i]) for i, h in enumerate(hyper)]
    else:
        groups = groups_fn(model)
    config = {"train_micro_batch_size_per_gpu": 3, "gradient_clipping": 0.0, "zero_optimization": {"stage": stage}}
    engine, optimizer, _, _ = zeroshard.initialize(
        model=model, model_parameters=groups, optimizer=lambda g: ShardedMuon(g), config=config
    )
    return engine, optimizer


@pytest.mark.parametrize("stage", [0, 3])
def test_sharded_muon_on_one_rank_equals_muon(stage):
    """The engine's flat masters give the same update as Muon on the module's parameters.
    Elementwise maths on the same values and the same NS calls: bitwise equal."""
    engine, optimizer = _engine(stage)
    optimizer.attach_flats(engine.flats)
    model = Net()
    reference = Muon(model, **muon_kwargs("gram", True))
    for x, y in batches():
        engine.backward(engine(x, y))
        engine.step()
        reference.zero_grad()
        model(x, y).backward()
        reference.step()
    ours = {n: zeroshard.safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()}
    for name, p in model.named_parameters():
        assert torch.equal(ours[name], p.detach()), name


def test_state_is_one_tensor_for_muon_masters():
    engine, optimizer = _engine(1)
    optimizer.attach_flats(engine.flats)
    x, y = batches()[0]
    engine.backward(engine(x, y))
    engine.step()
    for group in optimizer.param_groups:
        for master in group["params"]:
            keys = set(optimizer.state[master])
            assert keys == ({"momentum_buffer"} if group["use_muon"] else {"step", "exp_avg", "exp_avg_sq"})
            assert all(v.shape == master.shape for k, v in optimizer.state[master].items() if k != "step")


def test_a_vector_in_a_muon_group_is_refused_not_skipped():
    engine, optimizer = _engine(2, groups_fn=lambda model: [{"params": list(model.parameters()), "use_muon": True}])
    with pytest.raises(ValueError, match=r"parameter 'gain' \(shape \(\)\) is in a Muon optimizer group"):
        optimizer.attach_flats(engine.flats)


def test_step_before_attach_flats_says_what_to_do():
    engine, _ = _engine(0)
    x, y = batches()[0]
    engine.backward(engine(x, y))
    with pytest.raises(RuntimeError, match=r"attach_flats\(engine.flats\)"):
        engine.step()


def test_bf16_masters_keep_fp32_momentum_when_the_plan_says_so():
    """bf16 masters with fp32 state (what bf16.bf16_master_weights_and_grads without
    bf16_optimizer_states asks for; the engine passes that dtype to `build_muon`). The
    momentum after one step is exactly (1 - beta) g of the fp32-cast gradient.

    The engine refuses an optimizer factory under that plan, so the config here keeps bf16
    state and the test gives ShardedMuon the fp32 state dtype itself."""
    model = Net()
    hyper, group_of = split_param_groups(model, [{}], {id(p): 0 for p in model.parameters()},
                                         {**muon_kwargs("gram", True), "betas": list(BETAS)})
    groups = [dict(h, params=[p for p in model.parameters() if group_of[id(p)] == i]) for i, h in enumerate(hyper)]
    config = {"train_micro_batch_size_per_gpu": 3, "gradient_clipping": 0.0, "zero_optimization": {"stage": 1},
              "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}}
    engine, optimizer, _, _ = zeroshard.initialize(
        model=model, model_parameters=groups, config=config,
        optimizer=lambda g: ShardedMuon(g, state_dtype=torch.float32),
    )
    optimizer.attach_flats(engine.flats)
    x, y = batches()[0]
    engine.backward(engine(x, y))
    grads = {id(f.master): f.grads.reduced_buffer().float().clone() for f in engine.flats}
    before = {id(f.master): f.master.clone() for f in engine.flats}
    engine.step()
    for group in optimizer.param_groups:
        for master in group["params"]:
            assert master.dtype == torch.bfloat16
            state = optimizer.state[master]
            if group["use_muon"]:
                momentum = state["momentum_buffer"]
                assert momentum.dtype == torch.float32
                assert torch.equal(momentum, grads[id(master)] * (1 - MOMENTUM))
            else:
                assert state["exp_avg"].dtype == torch.float32 and state["exp_avg_sq"].dtype == torch.float32
            assert not torch.equal(master, before[id(master)]), "the step moved the bf16 master"
