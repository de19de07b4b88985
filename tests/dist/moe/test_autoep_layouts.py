"""A remote-code-style DeepSeek-V3 (experts an nn.ModuleList of MLPs with gate_proj/up_proj/
down_proj, the gate's e_score_correction_bias an nn.Parameter) under the engine at world 2 with
default AutoEP keys (autoep_size 2), ranks holding different token counts (10 against 27):

* training equals one process running the unswapped model (its own per-token forward) on both
  ranks' batches: the AutoEP exchange agrees its split sizes by sending the counts first, so
  uneven batches need nothing more;
* `save_16bit_model` and `zeroshard to-fp32` write the model's own names and shapes: the
  unswapped model strict-loads both and holds exactly the engine's trained weights.
"""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file

from tests.dist.scenarios.autoep_layouts import CLIP, LR, STEPS, batch, train_and_export
from tests.unit.moe.remote_code_models import remote_deepseek_v3
from zeroshard.checkpoint.export import consolidate_fp32
from zeroshard.config.expert_parallel import ExpertParallelConfig
from zeroshard.moe.autoep.swap import replace_moe_layers

WORLD, TIMEOUT_S = 2, 600
STAGES = (2, 3)
# fp32 on both sides with the same routing; the expert matmuls and the gradient sums run in
# another order (stacked slices over both ranks' tokens against per-token Linear calls), a few
# ulp of O(1) values; SGD keeps that difference linear over 2 steps (largest gap observed: 6e-8).
FP32 = {"atol": 1e-5, "rtol": 1e-5}


@pytest.fixture(scope="module")
def runs(dist_pool, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("autoep-layouts"))
    return root, [dist_pool(WORLD).run(train_and_export, stage, root, timeout=TIMEOUT_S) for stage in STAGES]


def merged(results, step: int) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for r in results:
        for name, value in r["masters"][step].items():
            if name in out:
                torch.testing.assert_close(value, out[name], atol=0, rtol=0)
            out[name] = value
    return out


def as_autoep_names(model) -> dict[str, torch.Tensor]:
    """`model` (unswapped) swapped in one process and named as the scenario names masters."""
    swapped = copy.deepcopy(model)
    replace_moe_layers(swapped, ExpertParallelConfig(enabled=True), world_size=1)
    out = {}
    for name, p in swapped.named_parameters():
        if getattr(p, "allreduce", True) is False:
            out.update({f"{name}[{g}]": row for g, row in enumerate(p.detach())})
        else:
            out[name] = p.detach()
    return out


def reference_training() -> list[dict[str, torch.Tensor]]:
    """The unswapped model in one process: the mean over ranks of each rank's loss, clipped,
    plain SGD."""
    model = remote_deepseek_v3()
    params = [p for p in model.parameters()]
    optimizer = torch.optim.SGD(params, lr=LR)
    states = []
    for step in range(STEPS):
        optimizer.zero_grad()
        for rank in range(WORLD):
            x = batch(rank, step)
            (model(x, labels=x) / WORLD).backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        optimizer.step()
        states.append(as_autoep_names(model))
    return states


@pytest.mark.parametrize("stage", STAGES)
def test_uneven_batches_train_as_the_unswapped_model(runs, stage) -> None:
    _, results = runs
    reference = reference_training()
    for step in range(STEPS):
        mine = merged(results[STAGES.index(stage)], step)
        assert set(mine) == set(reference[step])
        for name, value in reference[step].items():
            torch.testing.assert_close(
                mine[name], value, **FP32, msg=lambda m, n=name, s=step: f"step {s + 1} {n}: {m}"
            )


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("export", ("save_16bit_model", "to-fp32"))
def test_exports_strict_load_into_the_unswapped_model(runs, stage, export) -> None:
    root, results = runs
    if export == "save_16bit_model":
        state = load_file(f"{root}/remote-{stage}.safetensors")
    else:
        state = consolidate_fp32(f"{root}/ckpt-{stage}", tag="t")
    unswapped = remote_deepseek_v3(seed=1)
    expected = unswapped.state_dict()
    assert set(state) == set(expected)
    assert all(state[k].shape == v.shape for k, v in expected.items())
    unswapped.load_state_dict(state, strict=True)
    trained = merged(results[STAGES.index(stage)], STEPS - 1)
    loaded = as_autoep_names(unswapped)
    assert set(loaded) == set(trained)
    for name, value in trained.items():  # fp32 training: the parameters are the masters
        torch.testing.assert_close(loaded[name], value, atol=0, rtol=0, msg=name)
