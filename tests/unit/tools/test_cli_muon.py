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
