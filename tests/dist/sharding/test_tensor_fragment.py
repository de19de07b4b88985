"""zeroshard.utils' tensor-fragment helpers write what they say, at stages 0-3 (2 ranks, fp32
and bf16): a set value is read back exactly, the module computes with a set master, and the
next SGD-with-momentum step applies a set gradient and a set momentum buffer, checked against
the update computed by hand in fp32 (tolerance: 1 ulp-level, rtol 1e-6, since torch's SGD may
use its foreach kernel). Local parts of all ranks make up the whole parameter. A frozen
parameter: the getters answer None (as DeepSpeed 0.19's: its `safe_get_full_grad` finds no
`.grad`, no `ds_id` optimizer mapping and no `_hp_mapping` for it), by zeroshard.utils' names
and by the top-level `zeroshard.safe_get_full_*` alike (one function each), and the setters
refuse it."""

from __future__ import annotations

import pytest
import torch

from tests.dist.scenarios.tensor_fragment import LR, MOMENTUM

STAGES = (0, 1, 2, 3)
MODES = ("fp32", "bf16")
CASES = [(stage, mode) for mode in MODES for stage in STAGES]
PARAM_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.fixture(scope="module")
def results(dist_pool):
    from tests.dist.scenarios.tensor_fragment import run_all_scenarios

    per_rank = dist_pool(2).run(run_all_scenarios, CASES, timeout=600)
    return {case: per_rank[0][i] for i, case in enumerate(CASES)}


def _equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _close(a: dict, b: dict) -> None:
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("case", CASES, ids=[f"stage{s}-{m}" for s, m in CASES])
def test_set_then_get_and_the_next_step_uses_it(results, case) -> None:
    out = results[case]
    assert out["frozen_getters"] == [None] * 5
    assert out["frozen_top_level_getters"] == [None] * 3
    assert out["same_functions"] == [True] * 3
    assert "frozen" in out["frozen_setter"]

    _equal(out["weights_read"], out["weights"])
    _equal(out["module_after_set"], {n: w.to(PARAM_DTYPE[case[1]]) for n, w in out["weights"].items()})
    _equal(out["grads_read"], out["grads"])
    _equal(out["grads_doubled"], {n: g * 2 for n, g in out["grads"].items()})

    # Step 1 (SGD, momentum buffer starts as the gradient): w - lr * 2g.
    _close(out["after_step1"], {n: w - LR * (2 * out["grads"][n]) for n, w in out["weights"].items()})
    _close(out["momentum1"], {n: 2 * g for n, g in out["grads"].items()})
    # Step 2 with the momentum buffer that was set: buf = m * b + g2; w1 - lr * buf.
    _equal(out["buffers_read"], out["buffers"])
    expected = {
        n: w1 - LR * (MOMENTUM * out["buffers"][n] + out["grads2"][n]) for n, w1 in out["after_step1"].items()
    }
    _close(out["after_step2"], expected)


@pytest.mark.parametrize("case", CASES, ids=[f"stage{s}-{m}" for s, m in CASES])
def test_local_parts_make_the_whole(results, case) -> None:
    out = results[case]
    stage = case[0]
    by_rank = out["local_parts"]
    for name, (weight, grad, momentum) in out["after_local_set"].items():
        parts = [rank_parts[name] for rank_parts in by_rank]
        if stage == 0:  # the master is whole on every rank
            whole = parts[0]
            assert all(torch.equal(p[0], whole[0]) for p in parts), name
        else:
            whole = [torch.cat([p[k] for p in parts]) for k in range(3)]
        assert torch.equal(whole[0], out["after_step2"][name].reshape(-1)), name
        assert torch.equal(weight.reshape(-1), whole[0] + 1.0), name
        assert torch.equal(grad.reshape(-1), whole[1] * 3.0), name
        assert torch.equal(momentum.reshape(-1), whole[2] - 1.0), name


# DeepSpeed 0.19's TestTensorFragmentSet, at every stage (DeepSpeed: 1-3; its local setters at
# stage 3 only), bf16 and fp16 (fp32 reads back exactly in the scenario above), and with the
# optimizer offloaded to the host.
DS_CASES = [(stage, mode, False) for stage in STAGES for mode in ("bf16", "fp16")]
DS_CASES += [(stage, "bf16", True) for stage in (1, 3)]


@pytest.fixture(scope="module")
def deepspeed_set_results(dist_pool):
    from tests.dist.scenarios.tensor_fragment import run_deepspeed_set_scenarios

    per_rank = dist_pool(2).run(run_deepspeed_set_scenarios, DS_CASES, timeout=600)
    return {case: [rank[i] for rank in per_rank] for i, case in enumerate(DS_CASES)}


@pytest.mark.parametrize("case", DS_CASES, ids=[f"stage{s}-{m}{'-offload' if o else ''}" for s, m, o in DS_CASES])
def test_deepspeed_set_then_get_is_exact(deepspeed_set_results, case) -> None:
    for rank, checks in enumerate(deepspeed_set_results[case]):
        failed = [name for name, ok in checks.items() if not ok]
        assert checks and not failed, (rank, failed)
