"""Frozen experts stay frozen and saved (issue 31, items 1 and 2), world 2 and 4, ZeRO 0-3.

* DeepSpeed `MoE` layer, experts and the embedding frozen, one step at lr 0.1: the checkpoint
  holds every global expert by its global name (not rank 0's under local names); a fresh
  engine whose frozen weights start elsewhere loads it exactly, at the same or another
  ep_size and stage; `consolidate_fp32` gives the ep_size 1 model's names.
* AutoEP on a tiny Mixtral with frozen experts, one step at lr 0.1: the expert stacks stay
  frozen and unchanged, the router trains; `save_16bit_model` and `consolidate_fp32` strict-load
  into the unswapped model with the original experts; the checkpoint loads at another
  autoep_size.

References, independent of the checkpoint code: the MoE model's initial weights (a function of
each global name), the unswapped Hugging Face model built from the same seed. Frozen values are
copies, so every comparison of them is exact (atol=0); so is a loaded master (a copy).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from tests.dist.scenarios.autoep import build_hf  # noqa: E402
from tests.dist.scenarios.frozen_experts import (  # noqa: E402
    LR,
    autoep_load,
    autoep_save,
    is_frozen_moe_param,
    moe_load,
    moe_save,
)
from tests.dist.scenarios.moe_engine import EngineCase, build_model, global_names  # noqa: E402

TIMEOUT_S = 600
EXACT = {"atol": 0, "rtol": 0}
# (world, saved case, loaded case, frozen when saved, frozen when loaded)
MOE = [(4, EngineCase(2, s), EngineCase(2, s), True, True) for s in range(4)] + [
    (4, EngineCase(2, 1), EngineCase(4, 3), True, True), (4, EngineCase(4, 2), EngineCase(1, 0), True, True),
    (4, EngineCase(2, 2), EngineCase(4, 1), True, False), (4, EngineCase(4, 3), EngineCase(2, 0), False, True),
] + [(2, EngineCase(2, s), EngineCase(2, s), True, True) for s in range(4)]
# (world, autoep_size, stage saved, autoep_size, stage loaded)
AUTOEP = [(2, 2, s, 1, (s + 1) % 4) for s in range(4)] + [(4, 4, 2, 2, 3), (4, 2, 1, 4, 0)]


def merged(per_rank: list[dict], key: str = "state") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for result in per_rank:
        for name, value in result[key].items():
            if name in out:
                torch.testing.assert_close(value, out[name], **EXACT)
            out[name] = value
    return out


@pytest.fixture(scope="module")
def moe_runs(dist_pool, tmp_path_factory):
    runs = []
    for i, (world, saved, loaded, was_frozen, frozen) in enumerate(MOE):
        root = str(tmp_path_factory.mktemp(f"frozen-moe-{i}"))
        save = dist_pool(world).run(moe_save, saved, root, was_frozen, timeout=TIMEOUT_S)
        load = dist_pool(world).run(moe_load, loaded, root, frozen, was_frozen, timeout=TIMEOUT_S)
        runs.append((root, save, load))
    return runs


@pytest.fixture(scope="module")
def moe_reference() -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in global_names(build_model(1)).items()}


def _label(world, saved, loaded, was_frozen, frozen) -> str:
    change = "" if was_frozen == frozen else ("-then-trained" if was_frozen else "-trained-then-frozen")
    return f"world{world}-{saved.label}-to-{loaded.label}{change}"


@pytest.mark.parametrize("index", range(len(MOE)), ids=[_label(*c) for c in MOE])
def test_moe_frozen_experts_saved_by_global_name_and_loaded_exactly(moe_runs, moe_reference, index) -> None:
    root, save, load = moe_runs[index]
    was_frozen = MOE[index][3]
    saved = merged(save)
    assert set(saved) == set(moe_reference)
    frozen = [n for n in moe_reference if is_frozen_moe_param(n)]
    assert len(frozen) == 2 * 4 * 4 + 2  # 2 layers x 4 experts x (2 weights, 2 biases), embed weight and bias
    for name in frozen:  # frozen: the initial value after the step; trained: moved
        if was_frozen:
            torch.testing.assert_close(saved[name], moe_reference[name], **EXACT, msg=name)
        else:
            assert not torch.equal(saved[name], moe_reference[name]), name
    assert any(not torch.equal(saved[n], moe_reference[n]) for n in moe_reference if n not in frozen)
    loaded = merged(load)
    assert set(loaded) == set(saved)
    for name, value in saved.items():  # frozen and trained alike: copies
        torch.testing.assert_close(loaded[name], value, **EXACT, msg=name)
    exports = {"fp32": save[0]["consolidated"], "16bit": load_file(f"{root}/model.safetensors")}
    for kind, state in exports.items():
        # the ep_size 1 model's names, every expert once; it loads them strictly
        assert set(state) == set(build_model(1).state_dict()), kind
        build_model(1).load_state_dict(state, strict=True)
        for name, value in saved.items():  # fp32 training: the 16-bit export holds the masters too
            torch.testing.assert_close(state[name], value, **EXACT, msg=f"{kind} {name}")


@pytest.fixture(scope="module")
def autoep_runs(dist_pool, tmp_path_factory):
    runs = []
    for i, (world, size, stage, load_size, load_stage) in enumerate(AUTOEP):
        root = str(tmp_path_factory.mktemp(f"frozen-autoep-{i}"))
        save = dist_pool(world).run(autoep_save, size, stage, root, timeout=TIMEOUT_S)
        load = dist_pool(world).run(autoep_load, load_size, load_stage, root, timeout=TIMEOUT_S)
        runs.append((root, save, load))
    return runs


@pytest.fixture(scope="module")
def unswapped() -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in build_hf("mixtral").state_dict().items()}


def _stacks_reference(unswapped) -> dict[str, torch.Tensor]:
    """The unswapped model's experts as AutoEP's global stacks: gate_up_proj = [w1; w3]."""
    out = {}
    for key, value in unswapped.items():
        if key.endswith("experts.gate_up_proj"):
            layer, ffn = key.removesuffix(".experts.gate_up_proj"), value.shape[1] // 2
            out[f"{layer}.experts.w1"], out[f"{layer}.experts.w3"] = value[:, :ffn], value[:, ffn:]
        elif key.endswith("experts.down_proj"):
            out[f"{key.removesuffix('.experts.down_proj')}.experts.w2"] = value
    return out


def _strict_load(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    model = build_hf("mixtral")
    model.load_state_dict(state, strict=True)
    return model.state_dict()


AUTOEP_IDS = [f"world{w}-ep{a}-s{s}-to-ep{b}-s{t}" for w, a, s, b, t in AUTOEP]


@pytest.mark.parametrize("index", range(len(AUTOEP)), ids=AUTOEP_IDS)
def test_autoep_frozen_experts_stay_frozen_and_exported(autoep_runs, unswapped, index) -> None:
    root, save, load = autoep_runs[index]
    reference = _stacks_reference(unswapped)
    after = save[0]
    assert set(after["stacks"]) == set(reference) and len(reference) == 6
    for name, value in reference.items():
        assert after["trainable"][name] is False, name
        torch.testing.assert_close(after["stacks"][name], value, **EXACT, msg=name)
    for name, value in after["routers"].items():  # the router trains: AdamW's first step moves by ~lr
        assert after["trainable"][name] is True
        assert (value - after["before"][name]).abs().max() > LR / 2, name
    exported = {"16bit": load_file(f"{root}/model.safetensors"), "fp32": after["consolidated"]}
    for kind, state in exported.items():
        held = _strict_load(state)
        for key, value in unswapped.items():
            if ".experts." in key:
                torch.testing.assert_close(held[key], value, **EXACT, msg=f"{kind} {key}")
        for name, value in after["routers"].items():
            key = name.replace(".router.gate.", ".gate.")
            torch.testing.assert_close(held[key], value, **EXACT, msg=f"{kind} {key}")
    loaded = load[0]
    for name, value in reference.items():
        torch.testing.assert_close(loaded["stacks"][name], value, **EXACT, msg=f"loaded {name}")
    for name, value in after["routers"].items():
        torch.testing.assert_close(loaded["routers"][name], value, **EXACT, msg=f"loaded {name}")

