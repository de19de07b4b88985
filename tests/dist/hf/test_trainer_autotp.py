"""AutoTP through the Hugging Face Trainer and the `deepspeed` alias, 2 CPU processes
(tests/dist/scenarios/trainer_autotp.py): the per-step losses equal the same Trainer run
without DeepSpeed (DDP), and the model `save_model` wrote (16-bit weights gathered over both
dimensions) loads with from_pretrained and equals the DDP run's weights.

Tolerance: fp32. The row-split layers sum two partial products and DDP averages two
half-batches, in other orders; losses (~4.9, float32 spacing 4.8e-7) within 2e-6 as
trainer_parallel's. The weights after 3 AdamW steps within 1e-3: AdamW divides each update by
sqrt(v) + 1e-8, so a component whose gradient is near 1e-8 moves by up to lr (1e-2) times any
relative change of it; measured 1.7e-4 at most (layers.0.mlp.gate_proj). The weights are
~2e-2 in size, so a piece written in the wrong place is off by far more.
"""

from __future__ import annotations

TIMEOUT_S = 600
ATOL = 2e-6
WEIGHTS_ATOL = 1e-3


def test_autotp_through_the_trainer(hf_pool, tmp_path) -> None:
    pool, alias = hf_pool
    runs = pool.run("tests.dist.scenarios.trainer_autotp:trainer_autotp", alias, str(tmp_path), timeout=TIMEOUT_S)
    for rank, out in enumerate(runs):
        assert (out["tp_size"], out["dp_size"]) == (2, 1)
        assert out["split_layers"] == ["LinearAllreduce", "LinearLayer"], out["split_layers"]
        tp, ddp = dict(out["tp"]), dict(out["ddp"])
        assert tp.pop("wrapper") == "Engine" and ddp.pop("wrapper") == "DistributedDataParallel"
        assert list(tp) == list(ddp) == [1, 2, 3], (tp, ddp)
        for step, loss in tp.items():
            assert abs(loss - ddp[step]) <= ATOL, (rank, step, loss, ddp[step])
    assert runs[0]["saved_vs_ddp"] is not None and runs[0]["saved_vs_ddp"] <= WEIGHTS_ATOL, runs[0]["saved_vs_ddp"]
