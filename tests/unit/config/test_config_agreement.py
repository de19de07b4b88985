"""`zeroshard explain` and `zeroshard.initialize` refuse the same configs with the same message.

Every bad config of tests/unit/config/test_config.py (read from its parametrize marks, so a case added
there is checked here too) and the strict-type, optimizer, scheduler and precision cases below
go through both: the CLI (exit 2, the message on stderr, no traceback) and initialize on a tiny
nn.Linear in one process (a ConfigError whose text is that message).
"""

import json
import warnings

import pytest
import torch

import zeroshard
from tests.unit.config import test_config
from zeroshard.cli import main
from zeroshard.config.schema import ConfigError

# test_config.py's tests whose parameters are bad configs (at world size 1).
_BAD_CONFIG_TESTS = (
    "test_unknown_keys_get_did_you_mean",
    "test_auto_must_be_resolved_before_initialize",
    "test_not_supported_keys_are_errors",
    "test_not_supported_optimizer_and_scheduler",
    "test_bad_values_name_the_key",
)


def _from_test_config() -> list[dict]:
    configs = []
    for name in _BAD_CONFIG_TESTS:
        for mark in getattr(test_config, name).pytestmark:
            if mark.name == "parametrize":
                configs.extend(case[0] for case in mark.args[1])
    return configs


# (config, a fragment the message must contain)
NEW_CASES = [
    ({"zero_optimization": {"stage": "2"}}, 'zero_optimization.stage="2": must be an integer. Write 2 without quotes.'),
    ({"gradient_clipping": "1.0"}, 'gradient_clipping="1.0": must be a number. Write 1.0 without quotes.'),
    ({"steps_per_print": True}, "steps_per_print=true: must be an integer."),
    ({"dataloader_drop_last": "yes"}, 'dataloader_drop_last="yes": must be true or false.'),
    ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}},
     "optimizer.params.betas=[0.9]: must be a list of two numbers in [0, 1)"),
    ({"optimizer": {"type": "Adam", "params": {"lr": "0.1"}}}, 'optimizer.params.lr="0.1": must be a number >= 0.0'),
    ({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "nesterov": "yes"}}},
     'optimizer.params.nesterov="yes": must be true or false.'),
    ({"optimizer": {"type": "AdamW", "params": {"bias_correction": False}}},
     "optimizer.params.bias_correction=false: not supported by zeroshard"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 0}}},
     "scheduler.params.total_num_steps=0: must be a positive number of optimizer steps."),
    ({"optimizer": {"type": "SGD", "params": {"lr": 0.1}},
      "scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine", "warmup_num_steps": -5}}},
     'scheduler.params.warmup_type="cosine": must be \'log\' or \'linear\'.'),
    ({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.1}}},
     "scheduler.params.cycle_max_lr: required by OneCycle; add it."),
    ({"optimizer": {"type": "Muon", "params": {"momentun": 0.9}}},
     "optimizer.params.momentun: unknown key for optimizer type 'Muon'. Did you mean 'momentum'?"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}},
     "bf16.enabled and fp16.enabled are both true: pick one precision."),
    ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}, "optimizer": {"type": "SGD"}},
     "optimizer.type=SGD: its momentum is kept in the master weights' dtype"),
    ({"torch_autocast": {"enabled": True, "lower_precision_safe_modules": ["nope.Missing"]}},
     'torch_autocast.lower_precision_safe_modules="nope.Missing": does not import'),
    ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 3}, "train_batch_size=8 is not divisible"),
    ({"checkpoint": {"tag_validation": "Sometimes"}}, 'checkpoint.tag_validation="Sometimes"'),
    ({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}}, "bfloat16="),
    # test_config.py's other bad configs, whose tests take no parameters.
    ({"zero_optimization": {"stgae": 2}, "fp16": {"loss_scale": -1}, "train_batch_size": "auto"}, "invalid config:\n"),
    ({"train_micro_batch_size_per_gpu": 0}, "train_micro_batch_size_per_gpu=0: Input should be greater than"),
    # Several problems at once, from the per-key and the cross-section rules alike.
    ({"zero_optimization": {"stage": 2.5}, "fp16": {"enabled": True}, "bf16": {"enabled": True},
      "optimizer": {"type": "Muon", "params": {"ns_steps": 0}}}, "invalid config:\n"),
]

ALL = [(raw, None) for raw in _from_test_config()] + NEW_CASES


def _explain_message(tmp_path, capsys, raw) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(raw))
    assert main(["explain", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    prefix = f"zeroshard explain: {path}: "
    assert err.startswith(prefix)
    return err[len(prefix):].rstrip("\n")


def _initialize_message(raw) -> str:
    model = torch.nn.Linear(4, 2)
    with pytest.raises(ConfigError) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        zeroshard.initialize(model=model, model_parameters=model.parameters(), config=raw, dist_init_required=False)
    return str(info.value)


def test_the_cases_come_from_test_config():
    assert len(_from_test_config()) >= 35  # the marks were found (a rename would empty this list)


@pytest.mark.parametrize("raw, fragment", ALL, ids=[json.dumps(r)[:60] for r, _ in ALL])
def test_explain_and_initialize_refuse_with_the_same_message(tmp_path, capsys, raw, fragment):
    from_explain = _explain_message(tmp_path, capsys, raw)
    assert from_explain == _initialize_message(raw)
    if fragment is not None:
        assert fragment in from_explain


def test_every_problem_at_once_from_both_halves():
    raw = {"zero_optimization": {"stage": "2"}, "fp16": {"enabled": True}, "bf16": {"enabled": True},
           "optimizer": {"type": "Muon", "params": {"ns_steps": 0}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": -5}}}
    with pytest.raises(ConfigError) as info:
        zeroshard.initialize(model=torch.nn.Linear(2, 2), config=raw, dist_init_required=False)
    assert info.value.problems == [
        "scheduler.params.warmup_num_steps=-5: must be a positive integer.",
        'zero_optimization.stage="2": must be an integer. Write 2 without quotes.',
        "bf16.enabled and fp16.enabled are both true: pick one precision.",
        "optimizer.params.ns_steps=0: must be an integer >= 1.",
    ]
