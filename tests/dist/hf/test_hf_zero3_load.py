"""`from_pretrained` under ZeRO-3 through the `deepspeed` alias, 2 ranks, gloo.

With a stage-3 config alive (`HfDeepSpeedConfig`, or the Trainer's own through
`TrainingArguments(deepspeed=...)`), transformers 5.23 builds the model inside
`deepspeed.zero.Init(config_dict_or_path=...)` and copies a `save_pretrained` checkpoint
(safetensors) in one module at a time under `deepspeed.zero.GatheredParameters(params,
modifier_rank=0)`, rank 0 reading the values (tests/dist/scenarios/hf_zero3_load.py). Checked:

- every parameter is held as a part: empty, its full `ds_shape`/`ds_numel`, and ceil(numel / 2)
  elements of `ds_tensor` on this rank; tied embeddings stay one parameter;
- the gathered values and the buffers equal a plain `from_pretrained` of the same checkpoint
  exactly (both copy the same stored numbers; fp32 and bf16);
- at no point of the load did a rank hold more full parameters at once than the largest
  single module owns (one module's, which is less than one unit's: a decoder layer).
"""

from __future__ import annotations

import math

import pytest
import torch

TIMEOUT_S = 300
CASES = [("untied", False, "float32"), ("tied", True, "float32"), ("bf16", False, "bfloat16")]


@pytest.fixture(scope="module")
def runs(hf_pool, tmp_path_factory):
    pool, alias = hf_pool
    directory = str(tmp_path_factory.mktemp("checkpoints"))
    return {
        "hf": pool.run("tests.dist.scenarios.hf_zero3_load:load_cases", alias, directory, CASES, timeout=TIMEOUT_S),
        "trainer": pool.run("tests.dist.scenarios.hf_zero3_load:trainer_config_load", alias, directory,
                            timeout=TIMEOUT_S),
    }


def _check_partitioned_and_equal(rank: int, label: str, out: dict) -> None:
    reference = out["reference"]
    assert out["values"].keys() == reference["values"].keys(), (rank, label)
    for name, held in out["held"].items():
        full = reference["values"][name]
        assert held["numel"] == 0, (rank, label, name, held)
        assert held["ds_shape"] == tuple(full.shape) and held["ds_numel"] == full.numel(), (rank, label, name)
        assert held["part"] == math.ceil(full.numel() / 2), (rank, label, name, held)
        assert held["dtype"] == full.dtype, (rank, label, name, held)
    for name, value in out["values"].items():
        expected = reference["values"][name]
        assert value.dtype == expected.dtype and torch.equal(value, expected), (rank, label, name)
    for name, value in reference["buffers"].items():
        assert torch.equal(out["buffers"][name], value), (rank, label, name)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c[0] for c in CASES])
def test_hf_deepspeed_config_load_is_partitioned_and_exact(runs, index: int) -> None:
    name, tie, _ = CASES[index]
    for rank, results in enumerate(runs["hf"]):
        out = results[index]
        _check_partitioned_and_equal(rank, name, out)
        assert out["tied"] is tie, (rank, name)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c[0] for c in CASES])
def test_no_rank_holds_more_than_one_module_in_full(runs, index: int) -> None:
    for rank, results in enumerate(runs["hf"]):
        out = results[index]
        largest = out["reference"]["largest_module"]
        assert 0 < out["peak_full_numel"] <= largest, (rank, CASES[index][0], out["peak_full_numel"], largest)
        assert largest < out["reference"]["model_numel"] / 4, "the model must be several modules for this to test"
        assert out["gathers"] > 0, "the checkpoint was copied in through GatheredParameters"


def test_trainer_config_load_is_partitioned_and_exact(runs) -> None:
    for rank, out in enumerate(runs["trainer"]):
        # The bucket sizes are still "auto" when the model is built: Init must not need them.
        assert out["autos_left"] == ["reduce_bucket_size", "stage3_param_persistence_threshold",
                                     "stage3_prefetch_bucket_size"], out["autos_left"]
        _check_partitioned_and_equal(rank, "trainer", out)
        assert out["peak_full_numel"] > 0


@pytest.fixture(scope="module")
def built(hf_pool):
    pool, alias = hf_pool
    return pool.run("tests.dist.scenarios.hf_zero3_load:from_config_and_resize", alias, timeout=TIMEOUT_S)


def test_from_config_under_zero3_is_partitioned_and_initialised(built) -> None:
    """No checkpoint to compare with: rank 0's initialisation must reach every rank (the same
    values on both), and be the config's (normal, std initializer_range = 0.02, for the linear
    and embedding weights: 20% covers the sampling error of >= 2048 draws; norms are ones)."""
    ranks = [out["values"] for out in built]
    assert all(out["partitioned"] for out in built)
    for name, value in ranks[0].items():
        assert torch.equal(value, ranks[1][name]), name
        if name.endswith("norm.weight"):
            assert torch.equal(value, torch.ones_like(value)), name
        else:
            assert abs(float(value.std()) - 0.02) < 0.004, (name, float(value.std()))


def test_resize_token_embeddings_under_zero3(built) -> None:
    """transformers builds the new embedding and head whole, outside zero.Init (modeling_utils.py
    `_get_resized_embeddings`), as with DeepSpeed; the old rows come from the gathered old ones."""
    for out in built:
        assert out["resized_whole"]
        for key, old_name in (("embed", "model.embed_tokens.weight"), ("head", "lm_head.weight")):
            resized, old = out["resized"][key], out["values"][old_name]
            assert resized.shape[0] == out["new_vocab"]
            assert torch.equal(resized[: out["vocab"]], old), f"{key}: the old rows are kept"
