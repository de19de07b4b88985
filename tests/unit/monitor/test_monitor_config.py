"""The monitor sections: DeepSpeed's keys and defaults, comet refused with its reason, a
monitor whose package is missing refused with the extra to install, typos refused."""

from __future__ import annotations

import importlib.util

import pytest

from zeroshard.config.error import ConfigError
from zeroshard.resolve import resolve_config

BASE = {"train_micro_batch_size_per_gpu": 1}


def test_deepspeed_defaults():
    cfg = resolve_config(BASE)
    assert not (cfg.csv_monitor.enabled or cfg.tensorboard.enabled or cfg.wandb.enabled)
    assert (cfg.csv_monitor.output_path, cfg.csv_monitor.job_name) == ("", "DeepSpeedJobName")
    assert (cfg.tensorboard.output_path, cfg.tensorboard.job_name) == ("", "DeepSpeedJobName")
    assert (cfg.wandb.project, cfg.wandb.group, cfg.wandb.team) == ("deepspeed", None, None)
    for key in ("csv_monitor", "tensorboard", "wandb", "comet"):
        assert key not in cfg.no_effect_keys


def test_monitors_are_no_longer_no_effect_keys():
    cfg = resolve_config({**BASE, "csv_monitor": {"enabled": True, "output_path": "x", "job_name": "j"}})
    assert cfg.csv_monitor.enabled and cfg.csv_monitor.output_path == "x"
    assert not [k for k in cfg.no_effect_keys if k.startswith("csv_monitor")]


def test_comet_is_refused_with_its_reason():
    with pytest.raises(ConfigError, match=r"comet.*comet_ml.*csv_monitor, tensorboard or wandb"):
        resolve_config({**BASE, "comet": {"enabled": True, "project": "p"}})


def test_comet_disabled_is_accepted():
    cfg = resolve_config({**BASE, "comet": {"enabled": False}})
    assert "comet" in cfg.no_effect_keys


def test_unknown_monitor_key_is_refused():
    with pytest.raises(ConfigError, match=r"csv_monitor.job_nam.*job_name"):
        resolve_config({**BASE, "csv_monitor": {"enabled": True, "job_nam": "j"}})


@pytest.mark.parametrize("section,extra", [("tensorboard", "tensorboard"), ("wandb", "wandb")])
def test_missing_package_names_the_extra(monkeypatch, section, extra):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == section else real(name, *a))
    with pytest.raises(ConfigError, match=rf"{section}.enabled=true: .*pip install 'zeroshard\[{extra}\]'"):
        resolve_config({**BASE, section: {"enabled": True}})
    resolve_config({**BASE, section: {"enabled": False}})  # off: the package is not needed


def test_explain_says_where_the_monitors_write(tmp_path):
    from zeroshard.tools.explain import explain_text

    config = tmp_path / "ds.json"
    config.write_text('{"train_micro_batch_size_per_gpu": 1, "csv_monitor": {"enabled": true, "output_path": "runs"}, '
                      '"wandb": {"enabled": true, "team": "me", "group": "g"}}')
    text = " ".join(explain_text(str(config)).split())  # the console wraps long lines
    assert ("monitors: csv_monitor: runs/DeepSpeedJobName/*.csv (rank 0); "
            "wandb: project me/deepspeed, group g (rank 0)") in text
    config.write_text('{"train_micro_batch_size_per_gpu": 1}')
    assert "monitors: none" in explain_text(str(config))
