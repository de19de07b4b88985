"""`initialize` on 2 ranks refuses a group size of 4 with the message `zeroshard explain
--world-size 2` gives (tests/unit/config/test_config_group_sizes.py), naming the key the user
wrote: `expert_parallel.autoep_size`, not the internal `ep_size`."""

from __future__ import annotations

import pytest

from tests.dist.scenarios.group_sizes import initialize_error
from zeroshard.config.schema import ConfigError
from zeroshard.resolve import resolve_config

TIMEOUT_S = 300
BASE = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


@pytest.mark.parametrize(
    "extra",
    [{"expert_parallel": {"enabled": True, "autoep_size": 4}}, {"zeroshard": {"shard_group_size": 4}}],
    ids=["autoep_size", "shard_group_size"],
)
def test_initialize_refuses_as_explain_does(dist_pool, extra) -> None:
    if "expert_parallel" in extra:
        pytest.importorskip("transformers")
    with pytest.raises(ConfigError) as explained:  # explain --world-size 2 resolves the same way
        resolve_config({**BASE, **extra}, world_size=2)
    messages = dist_pool(2).run(initialize_error, extra, timeout=TIMEOUT_S)
    key = "expert_parallel.autoep_size=4" if "expert_parallel" in extra else "zeroshard.shard_group_size=4"
    for message in messages:
        assert message == str(explained.value), message
        assert message.startswith(f"{key}: must divide the world size 2"), message
