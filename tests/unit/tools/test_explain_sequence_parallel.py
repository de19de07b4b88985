"""`zeroshard explain` shows the sequence-parallel layout and its activation-memory effect."""

import json

from zeroshard.cli import main


def test_explain_shows_the_data_by_sequence_layout(capsys, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 2,
                                "zero_optimization": {"stage": 3}}))
    assert main(["explain", str(path), "--world-size", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["batch"]["train_batch_size"] == 2  # micro 1 x 2 data-parallel replicas
    assert data["parallel"] == {
        "sequence_parallel_size": 2, "data_parallel_size": 2, "sequence_groups": [[0, 1], [2, 3]],
        "data_groups": [[0, 2], [1, 3]], "dense_sharded_over": 4, "activation_fraction": 0.5,
    }
    assert main(["explain", str(path), "--world-size", "4"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "x data-parallel 2 (world 4 / sequence 2)" in text
    assert "sequence parallelism (Ulysses): 2 data x 2 sequence ranks" in text
    assert "activations per rank: 1/2 of a sequence's" in text


def test_explain_without_sequence_parallelism_is_unchanged(capsys, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1}))
    assert main(["explain", str(path), "--world-size", "4"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "x world 4" in text and "sequence parallelism" not in text


def test_explain_gives_the_uneven_head_split_and_the_busiest_rank(capsys, tmp_path):
    """The demo's `medium` preset has 6 heads: over 4 sequence ranks Ulysses gives them 2, 2, 1, 1
    (DeepSpeed's uneven split), so the busiest rank holds 2/6 of a sequence's attention inputs,
    not 1/4 (an even split reads as before: the test above)."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 4,
                                "zero_optimization": {"stage": 3}}))
    assert main(["explain", str(path), "--world-size", "4", "--model", "medium", "--json"]) == 0
    attention = json.loads(capsys.readouterr().out)["parallel"]["attention"]
    assert attention == {"heads": 6, "kv_heads": 6, "query_heads_per_rank": [2, 2, 1, 1],
                         "kv_heads_per_rank": [2, 2, 1, 1], "busiest_fraction": 2 / 6}
    assert main(["explain", str(path), "--world-size", "4", "--model", "medium"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "attention holds the whole sequence for 2, 2, 1, 1 of the 6 heads" in text, text
    assert "the busiest rank holds 2/6 = 0.333 of a sequence's attention inputs" in text, text
