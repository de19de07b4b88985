"""Muon on ZeRO stages 0-3: the same update as a single-process reference of the formula.

The reference below is written from the issue's formula with plain torch in float64, on the
whole global batch, independently of zeroshard.optim. The engine runs in fp32 on W ranks;
its Muon matrices straddle shard boundaries (see `MuonNet`).

Tolerance. The engine's gradient is an fp32 sum in another order than the reference's
float64 one (relative error ~1e-7); Newton-Schulz in fp32 (either form) adds ~5e-6 on O
(entries ~0.3) for ill-conditioned inputs; times lr = 0.05 parameters move by well under
1e-6 per step. The largest difference seen over every case below is 6e-7; PARAM_ATOL = 5e-6
leaves a margin of eight and is still 500x smaller than what separates Muon's update from
SGD's or AdamW's on the same gradient (checked below).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zeroshard
from tests.dist.ns_reference import reference_newton_schulz
from zeroshard.comm import compat as _compat
from zeroshard.optim.muon.optimizer import ShardedMuon, matrix_layout, split_param_groups

VOCAB, DIM, SEQ, MICRO = 11, 6, 5, 2
STEPS = 2
LR, ADAM_LR, MOMENTUM, WD = 0.05, 0.01, 0.9, 0.1
BETAS, EPS = (0.9, 0.95), 1e-8
CLIP = 0.05  # far below the gradient norm of this model, so clipping really acts
PARAM_ATOL = 5e-6
MUON_PARAMS = ("blocks.0.up.weight", "blocks.0.down.weight", "blocks.0.experts",
               "blocks.1.up.weight", "blocks.1.down.weight", "blocks.1.experts", "conv.weight")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 2 * DIM)  # weight 12x6: tall (transposed in NS), scale sqrt(2)
        self.down = nn.Linear(2 * DIM, DIM, bias=False)  # 6x12: wide (the Gram form)
        self.experts = nn.Parameter(torch.randn(2, DIM, DIM) * 0.3)  # 3-D: two square experts
        self.experts.is_expert_group = True  # marked: a stack, orthogonalized per expert

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        mixed = torch.einsum("btd,edk->btk", h, self.experts) / 2
        return h + self.down(torch.tanh(self.up(self.norm(h)))) + torch.tanh(mixed)


class MuonNet(nn.Module):
    """Every kind Muon must tell apart: an embedding, a separate lm head, 1-D norms and
    biases, 2-D matrices (tall and wide), a 3-D expert stack and a 4-D conv weight. With
    2 or 3 ranks the blocks' flat buffers (Muon part: 216 elements) split inside matrices."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.conv = nn.Conv2d(1, 3, kernel_size=2)  # weight [3, 1, 2, 2] -> a 3x4 matrix
        self.lm_head = nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        feature = self.conv(h.unsqueeze(1))
        logits = self.lm_head(h)
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1)) + 0.1 * feature.pow(2).mean()


def build_model(seed: int = 0) -> MuonNet:
    torch.manual_seed(seed)
    return MuonNet()


def global_batches(world_size: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One global batch of world_size x MICRO rows per step; rank r reads rows [r*MICRO, (r+1)*MICRO)."""
    gen = torch.Generator().manual_seed(seed)
    rows = world_size * MICRO
    return [
        (torch.randint(0, VOCAB, (rows, SEQ), generator=gen), torch.randint(0, VOCAB, (rows, SEQ), generator=gen))
        for _ in range(STEPS)
    ]


def muon_params_cfg(ns_method: str, nesterov: bool = True) -> dict:
    return {"muon_lr": LR, "adam_lr": ADAM_LR, "momentum": MOMENTUM, "weight_decay": WD,
            "betas": list(BETAS), "eps": EPS, "ns_method": ns_method, "nesterov": nesterov}


# ------------------------------------------------------------------ reference (float64)
def reference_orthogonalized_update(u: torch.Tensor) -> torch.Tensor:
    """NS per matrix (per expert for 3-D, (out, rest) for 4-D), times sqrt(max(1, rows/cols))."""
    if u.dim() == 3:
        return torch.stack([reference_orthogonalized_update(e) for e in u])
    matrix = u.reshape(u.shape[0], -1)
    scale = math.sqrt(max(1.0, matrix.shape[0] / matrix.shape[1]))
    return (reference_newton_schulz(matrix) * scale).reshape(u.shape)


def is_muon_param(name: str, p: torch.Tensor) -> bool:
    return p.dim() >= 2 and "embed" not in name and "lm_head" not in name


def reference_run(world_size: int, clip: float, nesterov: bool = True, kind: str = "muon") -> list[dict]:
    """Parameters after each step, from one process on the global batch.

    kind: "muon" (the formula), or "sgd" / "adamw" for every parameter (to show Muon ran).
    """
    model = build_model().double()
    params = dict(model.named_parameters())
    state: dict[str, dict[str, torch.Tensor]] = {n: {} for n in params}
    history = []
    for step, (x, y) in enumerate(global_batches(world_size), start=1):
        model.zero_grad()
        model(x, y).backward()
        grads = {n: p.grad.detach().clone() for n, p in params.items()}
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads.values()))
        if clip > 0 and clip / (norm + 1e-6) < 1:
            grads = {n: g * (clip / (norm + 1e-6)) for n, g in grads.items()}
        with torch.no_grad():
            for n, p in params.items():
                g, s = grads[n], state[n]
                if kind == "sgd":
                    p.copy_(p - LR * g)
                elif kind == "muon" and is_muon_param(n, p):
                    s["m"] = MOMENTUM * s.get("m", torch.zeros_like(p)) + (1 - MOMENTUM) * g
                    u = (1 - MOMENTUM) * g + MOMENTUM * s["m"] if nesterov else s["m"]
                    p.copy_(p * (1 - LR * WD) - LR * reference_orthogonalized_update(u))
                else:
                    lr = ADAM_LR if kind == "muon" else LR
                    s["m1"] = BETAS[0] * s.get("m1", torch.zeros_like(p)) + (1 - BETAS[0]) * g
                    s["v"] = BETAS[1] * s.get("v", torch.zeros_like(p)) + (1 - BETAS[1]) * g * g
                    m_hat, v_hat = s["m1"] / (1 - BETAS[0] ** step), s["v"] / (1 - BETAS[1] ** step)
                    p.copy_(p * (1 - lr * WD) - lr * m_hat / (v_hat.sqrt() + EPS))
        history.append({n: p.detach().clone() for n, p in params.items()})
    return history


# ------------------------------------------------------------------- rank-side tasks
def _engine(stage: int, ns_method: str, clip: float, nesterov: bool = True, mode: str = "fp32"):
    model = build_model()
    params_cfg = muon_params_cfg(ns_method, nesterov)
    # Until the engine builds Muon from the config (see the module report), the test splits
    # the groups itself and hands the engine a factory; the flats are attached after init.
    everything = {id(p): 0 for p in model.parameters()}
    hyper, group_of = split_param_groups(model, [{}], everything, params_cfg)
    groups = [dict(h, params=[p for p in model.parameters() if group_of[id(p)] == i]) for i, h in enumerate(hyper)]
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": clip,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 1000,
    }
    if mode == "bf16":
        config["bf16"] = {"enabled": True}
    engine, optimizer, _, _ = zeroshard.initialize(
        model=model, model_parameters=groups, optimizer=lambda g: ShardedMuon(g), config=config
    )
    optimizer.attach_flats(engine.flats)
    return engine


def _full_params(engine) -> dict[str, torch.Tensor]:
    """Every parameter's fp32 master, full size: one all-gather per flat buffer (what
    `safe_get_full_fp32_param` does per parameter, with fewer collectives)."""
    full = {}
    for flat in engine.flats:
        master = flat.master.detach().float()
        if master.numel() != flat.padded_numel:
            gathered = torch.empty(flat.padded_numel)
            _compat.all_gather_single(gathered, master.contiguous())
            master = gathered
        for index, name in enumerate(flat.names):
            full[name] = flat.param_view(master, index).clone()
    return full


def _local_rows(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    rank = torch.distributed.get_rank()
    x, y = batch
    return x[rank * MICRO : (rank + 1) * MICRO], y[rank * MICRO : (rank + 1) * MICRO]


def train_cases(cases: list[tuple[int, str, float, bool]]) -> list[dict]:
    """Per case (stage, ns_method, clip, nesterov): full parameters after each step, and the
    collectives tagged "muon" of the first step."""
    world_size = torch.distributed.get_world_size()
    results = []
    for stage, ns_method, clip, nesterov in cases:
        engine = _engine(stage, ns_method, clip, nesterov)
        history, muon_comm = [], []
        for step, batch in enumerate(global_batches(world_size)):
            with zeroshard.comm.recording() as log:
                engine.backward(engine(*_local_rows(batch)))
                engine.step()
            if step == 0:
                muon_comm = [(r.op, r.dtype, r.numel) for r in log.records if r.tag == "muon"]
            history.append(_full_params(engine))
        muon_groups = engine.optimizer.param_groups
        muon_flats = [(f.padded_numel, max(math.prod(matrix_layout(s, len(s) == 3)[1:]) for s in f.shapes))
                      for f in engine.flats if muon_groups[f.optimizer_group]["use_muon"]]
        results.append({"history": history, "muon_comm": muon_comm, "muon_flats": muon_flats})
    return results


def overflow_step(stage: int) -> dict:
    """bf16 (overflow checks on): a clean step, then a step whose rank-1 loss is inf."""
    engine = _engine(stage, "gram", clip=1.0, mode="bf16")
    batches = global_batches(torch.distributed.get_world_size())
    named = dict(engine.module.named_parameters())
    snapshots = []
    for step, batch in enumerate(batches):
        loss = engine(*_local_rows(batch))
        if step == 1 and torch.distributed.get_rank() == 1:
            loss = loss * float("inf")
        engine.backward(loss)
        engine.step()
        snapshots.append({
            "params": _full_params(engine),
            "momentum": zeroshard.safe_get_full_optimizer_state(named["blocks.0.down.weight"], "momentum_buffer"),
        })
    return {"snapshots": snapshots, "skipped": engine.skipped_steps}


def _full_state(engine) -> dict[str, torch.Tensor]:
    """Full parameters plus every optimizer state tensor, by "name:key"."""
    full = _full_params(engine)
    kinds = {p: engine.optimizer.param_groups[engine.locate(p)[0].optimizer_group]["use_muon"]
             for _, p in engine.module.named_parameters()}
    for name, p in engine.module.named_parameters():
        keys = ("momentum_buffer",) if kinds[p] else ("exp_avg", "exp_avg_sq", "step")
        for key in keys:
            full[f"{name}:{key}"] = zeroshard.safe_get_full_optimizer_state(p, key)
    return full


def save_after_one_step(stage: int, ckpt_dir: str) -> list[dict]:
    """One step, a checkpoint, one more step: the full state after each step."""
    engine = _engine(stage, "gram", CLIP)
    snapshots = []
    for step, batch in enumerate(global_batches(torch.distributed.get_world_size())):
        engine.backward(engine(*_local_rows(batch)))
        engine.step()
        snapshots.append(_full_state(engine))
        if step == 0:
            engine.save_checkpoint(ckpt_dir, tag="step1")
    return snapshots


def load_and_continue(stage: int, ckpt_dir: str) -> list[dict]:
    """A fresh engine loads the step-1 checkpoint: its full state, then after step 2."""
    engine = _engine(stage, "gram", CLIP)
    engine.load_checkpoint(ckpt_dir, tag="step1")
    snapshots = [_full_state(engine)]
    batch = global_batches(torch.distributed.get_world_size())[1]
    engine.backward(engine(*_local_rows(batch)))
    engine.step()
    snapshots.append(_full_state(engine))
    return snapshots


# ------------------------------------------------------------------------- the tests
# World size 2: every stage x ns_method x clipping. World size 3: every stage with each
# ns_method once and each clipping setting once (half the runs, every value still on every stage).
CASES = {
    2: [(stage, ns, clip, True) for stage in (0, 1, 2, 3) for ns in ("gram", "standard") for clip in (0.0, CLIP)],
    3: [(stage, ns, clip, True) for stage in (0, 1, 2, 3) for ns, clip in (("gram", CLIP), ("standard", 0.0))],
}


def _assert_ranks_bitwise_equal(per_rank: list[dict], label: str) -> None:
    for rank, result in enumerate(per_rank[1:], start=1):
        for step, (ours, theirs) in enumerate(zip(per_rank[0]["history"], result["history"], strict=True)):
            for name in ours:
                assert torch.equal(ours[name], theirs[name]), f"{label} step {step + 1}: rank {rank} differs on {name}"


@pytest.mark.parametrize("world_size", [2, 3])
def test_muon_matches_reference_on_every_stage(dist_pool, world_size):
    per_rank = dist_pool(world_size).run(train_cases, CASES[world_size], timeout=240)
    references = {clip: reference_run(world_size, clip) for clip in (0.0, CLIP)}
    by_case = {}
    for index, (stage, ns, clip, _) in enumerate(CASES[world_size]):
        label = f"W={world_size} stage {stage} {ns} clip={clip}"
        results = [r[index] for r in per_rank]
        _assert_ranks_bitwise_equal(results, label)
        history = results[0]["history"]
        for step, (ours, ref) in enumerate(zip(history, references[clip], strict=True), start=1):
            for name, value in ours.items():
                where = f"{label} step {step} {name}"
                torch.testing.assert_close(value.double(), ref[name], rtol=0, atol=PARAM_ATOL,
                                           msg=lambda m, where=where: f"{where}: {m}")
        by_case[(stage, ns, clip)] = history

    # The stages differ only in where each element lives: the same values, bit for bit.
    for (stage, ns, clip), history in by_case.items():
        for step, (ours, stage0) in enumerate(zip(history, by_case[(0, ns, clip)], strict=True), start=1):
            for name in ours:
                where = f"stage {stage} vs 0, {ns} clip={clip} step {step}: {name}"
                assert torch.equal(ours[name], stage0[name]), where


@pytest.mark.parametrize("world_size", [2])
def test_muon_really_ran(dist_pool, world_size):
    """The engine's update of every Muon matrix is orthogonalized momentum, not SGD's or AdamW's."""
    per_rank = dist_pool(world_size).run(train_cases, [(1, "gram", 0.0, True)], timeout=120)
    after = per_rank[0][0]["history"][0]
    initial = dict(build_model().named_parameters())
    sgd, adamw = reference_run(world_size, 0.0, kind="sgd")[0], reference_run(world_size, 0.0, kind="adamw")[0]
    for name in MUON_PARAMS:
        for other, label in ((sgd, "SGD"), (adamw, "AdamW")):
            gap = (after[name].double() - other[name]).abs().max().item()
            assert gap > 500 * PARAM_ATOL, f"{name}: within {gap:.2e} of {label}'s update; Muon did not run"
        # First step, m = (1 - beta) g and u ∝ g: the update is NS(g) * scale, whose nonzero
        # singular values the quintic puts in [0.68, 1.2] (per matrix) times the shape factor.
        # (Zero ones stay zero: up.weight's gradient has rank 5, its input is LayerNorm'd.)
        update = (initial[name].detach().double() * (1 - LR * WD) - after[name].double()) / LR
        matrices = list(update) if update.dim() == 3 else [update.reshape(update.shape[0], -1)]
        for matrix in matrices:
            scale = math.sqrt(max(1.0, matrix.shape[0] / matrix.shape[1]))
            sv = torch.linalg.svdvals(matrix) / scale
            sv = sv[sv > 1e-3]
            assert len(sv) >= min(matrix.shape) - 1, f"{name}: update singular values {sv.tolist()}"
            assert 0.6 < sv.min() and sv.max() < 1.25, f"{name}: update singular values {sv.tolist()}"


def test_nesterov_off_and_world_size_three_stage3(dist_pool):
    per_rank = dist_pool(3).run(train_cases, [(3, "gram", CLIP, False)], timeout=120)
    _assert_ranks_bitwise_equal([r[0] for r in per_rank], "nesterov off")
    reference = reference_run(3, CLIP, nesterov=False)
    for ours, ref in zip(per_rank[0][0]["history"], reference, strict=True):
        for name, value in ours.items():
            torch.testing.assert_close(value.double(), ref[name], rtol=0, atol=PARAM_ATOL)


@pytest.mark.parametrize("world_size", [2, 3])
def test_muon_collectives_are_tagged_and_sized(dist_pool, world_size):
    """Stage 0 exchanges packed O only; stages 1-3 also all-gather u (fp32, one full flat per
    Muon flat); every Muon collective is visible to the recorder under the tag "muon"."""
    per_rank = dist_pool(world_size).run(train_cases, [(0, "gram", 0.0, True), (2, "gram", 0.0, True)], timeout=120)
    stage0, stage2 = per_rank[0]
    flats = stage0["muon_flats"]
    assert flats, "the model has Muon flats"
    assert all(op == "all_gather" and dtype == torch.float32 for op, dtype, _ in stage0["muon_comm"])
    assert len(stage0["muon_comm"]) == len(flats)
    u_gathers = [numel for _, _, numel in stage2["muon_comm"][0::2]]
    assert u_gathers == [padded for padded, _ in flats]
    assert len(stage2["muon_comm"]) == 2 * len(flats)
    # Balanced owners: the packed exchange moves at most one flat plus one largest matrix
    # per rank, never W flats.
    for (_, _, packed), (padded, largest) in zip(stage0["muon_comm"], flats, strict=True):
        assert packed <= padded + world_size * largest, (packed, padded, largest)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_skipped_overflow_step_leaves_momentum_untouched(dist_pool, stage):
    per_rank = dist_pool(2).run(overflow_step, stage, timeout=120)
    for result in per_rank:
        assert result["skipped"] == 1
        first, second = result["snapshots"]
        assert first["momentum"].abs().sum() > 0, "the clean step built momentum"
        assert torch.equal(first["momentum"], second["momentum"])
        for name in first["params"]:
            assert torch.equal(first["params"][name], second["params"][name]), name


def _assert_same_state(ours: dict, theirs: dict, label: str) -> None:
    assert ours.keys() == theirs.keys(), label
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), f"{label}: {key}"


def test_checkpoint_holds_muon_momentum_and_reshards(dist_pool, tmp_path):
    """Saved on 2 ranks at stage 1; loaded on 2 ranks at stage 1 (resume: bitwise the
    uninterrupted run) and on 3 ranks at stage 3 (reshard: bitwise the saved state)."""
    saved = dist_pool(2).run(save_after_one_step, 1, str(tmp_path), timeout=120)[0]
    assert saved[0]["blocks.0.down.weight:momentum_buffer"].abs().sum() > 0
    resumed = dist_pool(2).run(load_and_continue, 1, str(tmp_path), timeout=120)[0]
    _assert_same_state(resumed[0], saved[0], "loaded on W=2")
    _assert_same_state(resumed[1], saved[1], "resumed step 2 on W=2")
    resharded = dist_pool(3).run(load_and_continue, 3, str(tmp_path), timeout=120)
    for rank, snapshots in enumerate(resharded):
        _assert_same_state(snapshots[0], saved[0], f"loaded on W=3 stage 3, rank {rank}")
