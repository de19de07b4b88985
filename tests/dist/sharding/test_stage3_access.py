"""Stage-3 parameters reached other ways than through their unit's forward, and read outside
a gather (issue 13 item 2; docs/reliability.md).

- A model whose forward calls a unit's submodules (a ModuleList of ModuleDicts calling
  block["norm"], block["linear"]) and a unit's submodule from the root trains at stage 3
  exactly as at stage 0 (losses and parameters bitwise equal: the stages sum the same values
  in the same order), in fp32 and bf16.
- Outside a gather a parameter is visibly empty: numel 0, `sum()` 0, `clone()` and
  `copy.deepcopy(engine.module)` empty, an op that needs the values a Python error (before:
  a full shape over 0 bytes, and SIGSEGV); `ds_shape` keeps the full shape.
- `engine.module.state_dict()` outside a gather raises an error naming GatheredParameters and
  save_16bit_model; inside `GatheredParameters` it is the full tensors, and `torch.save` of it
  loads back to the stage-0 values.
"""

from __future__ import annotations

import io

import pytest
import torch

from tests.dist.scenarios.stage3_access import train_dict_blocks


@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_submodules_called_directly_train_at_stage3_as_at_stage0(dist_pool, mode: str) -> None:
    stage0, stage3 = (dist_pool(2).run(train_dict_blocks, stage, mode, timeout=300) for stage in (0, 3))
    for rank in range(2):
        assert stage3[rank]["losses"] == stage0[rank]["losses"], (rank, stage0[rank]["losses"], stage3[rank]["losses"])
        for name, value in stage0[rank]["full"].items():
            assert torch.equal(stage3[rank]["full"][name], value), f"{mode} rank {rank}: {name} differs"
        saved = torch.load(io.BytesIO(stage3[rank]["saved"]), weights_only=True)
        assert set(saved) == set(stage0[rank]["full"])
        for name, value in stage0[rank]["full"].items():
            assert torch.equal(saved[name], value), f"{mode}: saved {name} differs from stage 0"

        outside = stage3[rank]["outside"]
        assert outside["numel"] == 0 and outside["shape"] == (0,) and outside["ds_shape"] == (8, 8), outside
        assert outside["sum"] == 0.0 and outside["clone_numel"] == 0, outside
        assert outside["deepcopy_numels"] and set(outside["deepcopy_numels"]) == {0}, outside
        assert stage3[rank]["use_error"] == "RuntimeError", stage3[rank]["use_error"]
        error = stage3[rank]["state_dict_error"]
        assert error is not None and "zeroshard.zero.GatheredParameters" in error and "save_16bit_model" in error, error
