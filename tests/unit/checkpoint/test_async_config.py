"""`checkpoint.writer` (DeepSpeed's writer section): `decoupled` switches asynchronous saves on;
the tuning keys are accepted with no effect; a mock writer and unknown keys are refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from zeroshard.checkpoint.async_save import decoupled
from zeroshard.config.error import ConfigError
from zeroshard.resolve import resolve_config


def _engine(config: dict) -> SimpleNamespace:
    return SimpleNamespace(config=resolve_config(config))


def test_decoupled_turns_asynchronous_saves_on():
    assert not decoupled(_engine({}))
    assert not decoupled(_engine({"checkpoint": {"writer": {"type": "python"}}}))
    assert decoupled(_engine({"checkpoint": {"writer": {"decoupled": True}}}))
    # A plain-table form of the section (engines built by hand in tests) reads the same.
    assert decoupled(SimpleNamespace(config=SimpleNamespace(checkpoint={"writer": {"decoupled": True}})))


@pytest.mark.filterwarnings("ignore:zeroshard accepts these DeepSpeed keys")
def test_deepspeed_writer_keys_are_accepted_with_no_effect():
    writer = {"type": "FAST", "decoupled": True, "io_buffer_size": 1 << 20, "io_buffer_double": False,
              "show_statistics": True, "data_parallel": "replica", "io_multiplier": 2}
    cfg = resolve_config({"checkpoint": {"writer": writer}})
    assert cfg.checkpoint.writer.decoupled is True
    assert {f"checkpoint.writer.{k}" for k in writer if k != "decoupled"} <= set(cfg.no_effect_keys)


@pytest.mark.parametrize(
    "writer,message",
    [
        ({"type": "mock"}, r'checkpoint\.writer\.type="mock": the mock writer writes nothing'),
        ({"decoupled": "true"}, r'checkpoint\.writer\.decoupled="true": must be true or false'),
        ({"decoupeld": True}, r"checkpoint\.writer\.decoupeld: unknown key\. Did you mean 'decoupled'\?"),
    ],
)
def test_bad_writer_settings_name_the_key(writer, message):
    with pytest.raises(ConfigError, match=message):
        resolve_config({"checkpoint": {"writer": writer}})
