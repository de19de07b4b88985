"""`zeroshard explain` shows which parameters Muon takes, decided on full shapes."""

import json
from pathlib import Path

from zeroshard.cli import main

CONFIG = Path(__file__).resolve().parents[3] / "examples" / "configs" / "zero2_muon.json"


def test_explain_json_lists_muon_and_adamw_parameters(capsys):
    assert main(["explain", str(CONFIG), "--model", "tiny", "--world-size", "3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    muon = data["model"]["muon"]
    # Hidden matrices go to Muon; embeddings (tied to the head), norms and biases to AdamW.
    assert "blocks.0.attn.c_attn.weight" in muon["muon"]
    assert "blocks.0.mlp.c_proj.weight" in muon["muon"]
    assert "wte.weight" in muon["adamw"]
    assert "blocks.0.ln_1.weight" in muon["adamw"]
    assert all(not name.endswith(".bias") for name in muon["muon"])


def test_explain_table_prints_the_muon_assignment(capsys):
    assert main(["explain", str(CONFIG), "--model", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "Muon: which optimizer each parameter gets" in out
    assert "nn.Embedding weight" in out


def _muon_config(tmp_path, **params):
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Muon", "params": params}}
    path = tmp_path / "muon.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_explain_shows_the_muon_plan_per_group(tmp_path, capsys):
    """Per optimizer group: Muon or AdamW, per-head or whole with the block shapes, ns_method and
    the Newton-Schulz compute dtype (tiny Llama: 4 query heads, 2 key/value heads of 6, hidden 16)."""
    config = _muon_config(tmp_path, per_head_muon=True, per_head_muon_output=True, ns_method="standard")
    model = "tests.unit.optim.muon_models:tiny_llama"
    assert main(["explain", config, "--model", model, "--json"]) == 0
    muon, adamw = json.loads(capsys.readouterr().out)["model"]["muon"]["groups"]
    assert muon["optimizer"] == "Muon" and muon["per_head"] and muon["per_head_tensors"] == 4
    assert muon["blocks"] == {"4 row heads 6x16": 1, "2 row heads 6x16": 2, "4 column heads 16x6": 1,
                              "whole 24x16": 2, "whole 16x24": 1}
    assert muon["ns_matrices"] == 4 + 2 + 2 + 4 + 3
    assert muon["ns_method"] == "standard" and muon["ns_compute_dtype"] == {"gpu": "bf16", "cpu": "fp32"}
    assert adamw["optimizer"] == "AdamW" and adamw["tensors"] == 5  # embeddings, lm_head, three norms
    assert main(["explain", config, "--model", model]) == 0
    out = capsys.readouterr().out
    assert "Muon: optimizer groups" in out and "1 x 4 row heads 6x16" in out and "4 column heads" in out
    assert "per-head: 2 row blocks 6x16" in out  # k_proj in the per-parameter table


def test_explain_whole_and_offloaded(tmp_path, capsys):
    config = _muon_config(tmp_path, ns_dtype="bf16")
    data = json.loads(open(config).read())
    data["zero_optimization"] = {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    (tmp_path / "muon.json").write_text(json.dumps(data))
    assert main(["explain", config, "--model", "tests.unit.optim.muon_models:tiny_llama", "--json"]) == 0
    muon = json.loads(capsys.readouterr().out)["model"]["muon"]["groups"][0]
    assert not muon["per_head"] and muon["blocks"]["whole 24x16"] == 3 and muon["ns_method"] == "gram"
    assert muon["ns_compute_dtype"] == {"host (optimizer offload)": "bf16"}
