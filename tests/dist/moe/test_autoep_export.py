"""AutoEP checkpoints and exports (world 4): `save_16bit_model` and `zeroshard to-fp32` write the
original Hugging Face names and per-expert layout, so the unswapped model strict-loads them and
holds the trained weights; a checkpoint saved at one autoep_size loads at another.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from tests.dist.scenarios.autoep import build_hf, load_case, save_case  # noqa: E402
from zeroshard.checkpoint.export import consolidate_fp32  # noqa: E402
from zeroshard.config.expert_parallel import ExpertParallelConfig  # noqa: E402
from zeroshard.module_inject.auto_ep import replace_moe_layers  # noqa: E402

WORLD, TIMEOUT_S = 4, 900
SAVES = [("deepseek_v3", 2, 2), ("deepseek_v3", 4, 3), ("mixtral", 2, 1)]


def merged(results, key="masters") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for r in results:
        for name, value in r[key].items():
            if name in out:
                torch.testing.assert_close(value, out[name], atol=0, rtol=0)
            out[name] = value
    return out


@pytest.fixture(scope="module")
def runs(dist_pool, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("autoep-export"))
    pool = dist_pool(WORLD)
    saved_runs = [pool.run(save_case, kind, size, stage, root, timeout=TIMEOUT_S) for kind, size, stage in SAVES]
    saved = [merged(r) for r in saved_runs]
    saved_exp_avg = merged(saved_runs[0], "exp_avg")
    # DeepSeek-V3 saved at autoep_size 2 (stage 2), loaded at 4 (stage 3) and 1 (stage 0).
    ckpt = f"{root}/ckpt-deepseek_v3-2-2-AdamW"
    loaded_runs = {size: pool.run(load_case, "deepseek_v3", size, stage, ckpt, timeout=TIMEOUT_S)
                   for size, stage in ((4, 3), (1, 0))}
    loaded = {size: (merged(r), merged(r, "exp_avg")) for size, r in loaded_runs.items()}
    # Muon + AutoEP + ZeRO-2: saved at autoep_size 2, loaded at 4.
    muon_saved = merged(pool.run(save_case, "deepseek_v3", 2, 2, root, "Muon", timeout=TIMEOUT_S))
    muon_ckpt = f"{root}/ckpt-deepseek_v3-2-2-Muon"
    muon_loaded = merged(pool.run(load_case, "deepseek_v3", 4, 2, muon_ckpt, "Muon", timeout=TIMEOUT_S))
    return root, saved, loaded, saved_exp_avg, (muon_saved, muon_loaded)


def as_autoep_names(state: dict[str, torch.Tensor], kind: str) -> dict[str, torch.Tensor]:
    """Load `state` into the unswapped model (strict), swap it in one process (autoep_size 1),
    and name its weights as the scenarios do (stacks split by global expert)."""
    model = build_hf(kind)
    model.load_state_dict(state, strict=True)
    replace_moe_layers(model, ExpertParallelConfig(enabled=True), world_size=1)
    out = {}
    for name, p in model.named_parameters():
        if getattr(p, "allreduce", True) is False:
            out.update({f"{name}[{g}]": row for g, row in enumerate(p.detach())})
        else:
            out[name] = p.detach()
    return out


@pytest.mark.parametrize("index", range(len(SAVES)), ids=[f"{k}-ep{s}-stage{st}" for k, s, st in SAVES])
def test_16bit_export_strict_loads_into_the_unswapped_model(runs, index) -> None:
    root, saved, *_ = runs
    kind, size, stage = SAVES[index]
    state = load_file(f"{root}/{kind}-{size}-{stage}-AdamW.safetensors")
    assert not any(".router." in k or ".experts.w1" in k for k in state)
    mine = as_autoep_names(state, kind)
    assert set(mine) == set(saved[index])
    for name, value in saved[index].items():  # fp32 training: the parameters are the masters
        torch.testing.assert_close(mine[name], value, atol=0, rtol=0, msg=name)


@pytest.mark.parametrize("index", range(len(SAVES)), ids=[f"{k}-ep{s}-stage{st}" for k, s, st in SAVES])
def test_to_fp32_strict_loads_into_the_unswapped_model(runs, index) -> None:
    root, saved, *_ = runs
    kind, size, stage = SAVES[index]
    mine = as_autoep_names(consolidate_fp32(f"{root}/ckpt-{kind}-{size}-{stage}-AdamW", tag="t"), kind)
    for name, value in saved[index].items():
        torch.testing.assert_close(mine[name], value, atol=0, rtol=0, msg=name)


@pytest.mark.parametrize("size", (4, 1))
def test_checkpoint_loads_at_another_autoep_size(runs, size) -> None:
    _, saved, loaded, saved_exp_avg, _ = runs
    masters, exp_avg = loaded[size]
    assert set(masters) == set(saved[0]) == set(exp_avg)
    for name, value in saved[0].items():
        torch.testing.assert_close(masters[name], value, atol=0, rtol=0, msg=name)
        torch.testing.assert_close(exp_avg[name], saved_exp_avg[name], atol=0, rtol=0, msg=name)
    assert any(v.abs().max() > 0 for v in saved_exp_avg.values())


def test_muon_checkpoint_loads_at_another_autoep_size(runs) -> None:
    muon_saved, muon_loaded = runs[-1]
    assert set(muon_loaded) == set(muon_saved)
    for name, value in muon_saved.items():
        torch.testing.assert_close(muon_loaded[name], value, atol=0, rtol=0, msg=name)
