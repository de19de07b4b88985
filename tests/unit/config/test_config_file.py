"""Reading a config file: every unusable file is one ConfigError (explain: exit 2, no
traceback), HJSON is read as DeepSpeed reads it, and a key given twice is an error."""

import json
import warnings

import pytest
import torch

import zeroshard
from zeroshard.cli import main
from zeroshard.config.file import MAX_DEPTH
from zeroshard.config.schema import ConfigError
from zeroshard.resolve import resolve_config


def explain_fails(capsys, path) -> str:
    assert main(["explain", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err


def test_non_utf8_file_is_one_message(tmp_path, capsys):
    path = tmp_path / "latin1.json"
    path.write_bytes('{"zero_optimization": {"stage": 2}, "comment": "caf\u00e9"}'.encode("latin-1"))
    err = explain_fails(capsys, path)
    assert f"config file '{path}' is not UTF-8 text (byte 0xe9 at offset" in err and "Save it as UTF-8." in err
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        resolve_config(path)


def test_utf8_with_bom_is_read(tmp_path):
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"zero_optimization": {"stage": 1}}).encode())
    assert resolve_config(path).zero_optimization.stage == 1


@pytest.mark.parametrize("depth", [MAX_DEPTH + 5, 100_000])
def test_deeply_nested_file_is_a_config_error_not_recursion(tmp_path, capsys, depth):
    path = tmp_path / "deep.json"
    path.write_text('{"tensorboard": ' + "[" * depth + "]" * depth + "}")
    err = explain_fails(capsys, path)
    assert "nested" in err and "RecursionError" not in err


def test_deeply_nested_dict_is_a_config_error():
    raw: dict = {}
    node = raw
    for _ in range(5000):  # past the interpreter's recursion limit
        node["a"] = {}
        node = node["a"]
    with pytest.raises(ConfigError, match=f"the config dict is nested more than {MAX_DEPTH} levels deep"):
        resolve_config(raw)
    with pytest.raises(ConfigError, match="nested more than"):
        zeroshard.initialize(model=torch.nn.Linear(2, 2), config=raw, dist_init_required=False)


def test_duplicate_keys_are_named(tmp_path, capsys):
    path = tmp_path / "dup.json"
    path.write_text('{"zero_optimization": {"stage": 2, "stage": 3}, "seed": 1, "seed": 1}')
    with pytest.raises(ConfigError) as info:
        resolve_config(path)
    assert info.value.problems == [
        f"seed: given more than once in config file '{path}' (JSON keeps only the last value). Keep one.",
        f"zero_optimization.stage: given more than once in config file '{path}' (JSON keeps only the last "
        "value). Keep one.",
    ]
    assert main(["explain", str(path)]) == 2
    assert "zero_optimization.stage: given more than once" in capsys.readouterr().err


def test_hjson_file_as_deepspeed_reads_it(tmp_path):
    text = """
    # DeepSpeed reads its configs with the hjson package
    {
      train_micro_batch_size_per_gpu: 2
      gradient_accumulation_steps: 4
      zero_optimization: { stage: 3, reduce_bucket_size: 5e8 }
      optimizer: {
        // a quoteless string runs to the end of its line
        type: AdamW
        params: { lr: 3e-4, betas: [0.9, 0.95] }
      }
    }
    """
    expected = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 5e8},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95]}},
    }
    for name in ("ds.hjson", "ds.json"):  # a .json holding HJSON is read too, as DeepSpeed does
        path = tmp_path / name
        path.write_text(text)
        cfg = resolve_config(path, world_size=2)
        assert cfg.raw == expected
        assert (cfg.train_batch_size, cfg.zero_optimization.stage) == (16, 3)
        assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
        assert cfg.optimizer.params["betas"] == [0.9, 0.95]


def test_hjson_duplicate_keys_and_bad_hjson(tmp_path):
    path = tmp_path / "dup.hjson"
    path.write_text("{ seed: 1\n seed: 2 }")
    with pytest.raises(ConfigError, match="^seed: given more than once"):
        resolve_config(path)
    bad = tmp_path / "bad.hjson"
    bad.write_text("{ seed: [1, 2 }")
    with pytest.raises(ConfigError, match="is not valid HJSON"):
        resolve_config(bad)


def _engine():
    model = torch.nn.Linear(4, 2)
    engine, *_ = zeroshard.initialize(
        model=model, model_parameters=model.parameters(),
        config={"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}, dist_init_required=False,
    )
    return engine


def test_outer_autocast_warning_once_per_engine():
    """The config overrides a user's own torch.autocast: each engine says so once (a second
    engine in the same process has its own config, so it says it too)."""
    engines = [_engine(), _engine()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for engine in engines:
            for _ in range(3):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = engine(torch.randn(3, 4))
                assert out.dtype == torch.float32  # the config (fp32) won over the outer autocast
                engine.backward(out.sum())
                engine.step()
    messages = [str(w.message) for w in caught if "outer torch.autocast" in str(w.message)]
    assert len(messages) == 2
    assert all('"torch_autocast": {"enabled": true' in m for m in messages)
