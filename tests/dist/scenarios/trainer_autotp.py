"""AutoTP switched on through the Hugging Face Trainer with the `deepspeed` alias
(tests/dist/hf/test_trainer_autotp.py), 2 CPU processes, tensor 2 x data 1.

The user writes `"tensor_parallel": {"autotp_size": 2}` in the DeepSpeed config; transformers
calls `deepspeed.tp_model_init` (integrations/deepspeed.py), Accelerate gives both ranks the same
batches (its (tp,) mesh: process_index // tp) and calls `deepspeed.initialize`, which splits the
model; `save_model` asks the engine for the consolidated 16-bit weights
(`_consolidated_16bit_state_dict`, with stage3_gather_16bit_weights_on_model_save as DeepSpeed
requires). With one data-parallel replica each step trains on `per_device_train_batch_size`
samples. Reference: the same Trainer without DeepSpeed (DDP, 2 ranks) with half that per-device
batch: the same samples per step (as the ALST scenario of trainer_parallel.py).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from tests.dist.scenarios.hf_common import tiny_llama_config, use_alias
from tests.dist.scenarios.trainer_parallel import _TASK_ENV, TokenDataset, _reset, ds_config, train


def tiny_llama():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config())


def trainer_autotp(alias_dir: str, workdir: str) -> dict[str, Any]:
    use_alias(alias_dir)
    _TASK_ENV.clear()
    _TASK_ENV.update(os.environ)
    from transformers import LlamaForCausalLM

    from tests.dist.scenarios.hf_common import VOCAB

    data = TokenDataset(VOCAB)
    ddp_trainer, ddp = train(workdir, "tp_ddp", tiny_llama(), data, None, 1)
    ddp_weights = {k: v.detach().float().clone() for k, v in ddp_trainer.model.state_dict().items()}
    config = ds_config(3, tensor_parallel={"autotp_size": 2})
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    trainer, got = train(workdir, "tp_s3", tiny_llama(), data, config, 2)
    engine = trainer.model_wrapped
    split = sorted({type(m).__name__ for m in engine.module.modules() if type(m).__name__.startswith("Linear")})
    out_dir = os.path.join(workdir, "tp_saved")
    trainer.save_model(out_dir)
    result = {"tp_size": engine.mp_world_size, "dp_size": engine.dp_world_size}
    del trainer, engine
    _reset()  # from_pretrained below would build under zero.Init (stage 3's HF config) on rank 0 alone
    saved = None
    if torch.distributed.get_rank() == 0:
        loaded = LlamaForCausalLM.from_pretrained(out_dir)
        saved = max(float((v.float() - ddp_weights[k]).abs().max()) for k, v in loaded.state_dict().items())
    result.update({"ddp": ddp, "tp": got, "split_layers": split, "saved_vs_ddp": saved})
    return result
