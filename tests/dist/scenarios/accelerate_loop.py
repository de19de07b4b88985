"""A plain Accelerate training loop on zeroshard through the `deepspeed` alias
(tests/dist/hf/test_accelerate_loop.py), and the same loop without DeepSpeed.

The loop is the one Accelerate documents: `accelerator.prepare(model, optimizer, dataloader,
scheduler)`, `accelerator.backward(loss)`, `optimizer.step()`, `scheduler.step()`,
`optimizer.zero_grad()`, with `accelerator.accumulate(model)` when accumulating. Under DeepSpeed,
`accelerator.backward` calls `engine.set_gradient_accumulation_boundary`, `engine.backward` and,
at the boundary, `engine.step()`; the optimizer's own step and zero_grad are no-ops.

[Note: accelerate's process count on a CPU-only machine]
accelerate 1.15's PartialState picks its process-group backend from the device it finds (CUDA,
XPU, NPU, HPU, ...). Under DeepSpeed on a machine with none (`cpu=False`, which `accelerate
launch` leaves for DeepSpeed), it finds no backend and reports `num_processes == 1`, although
`deepspeed.comm.init_distributed` formed a group of every launched rank. So it does not split
the dataloader (every rank reads every batch), and it would fill an "auto" `train_batch_size`
for one process (then refused by the batch triangle, by DeepSpeed as by zeroshard). With CPU
mode on (`--cpu`, `Accelerator(cpu=True)`) it does not use DeepSpeed at all. That is
accelerate's code, the same with the real DeepSpeed; the configs here set the micro-batch and
leave `train_batch_size` out. The reference is therefore one process running the same loop on
the same batches without DeepSpeed (every rank's batch is the same, so the data-parallel mean
gradient is that batch's gradient).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch

from tests.dist.scenarios.hf_common import tiny_llama_config, token_rows, use_alias

ROWS, SEQ, MICRO, LR, STEPS = 16, 12, 2, 1e-2, 4


def _model():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config())


def _loader():
    return torch.utils.data.DataLoader(token_rows(ROWS, SEQ, seed=3), batch_size=MICRO, shuffle=False)


def reference_losses(ga: int, clip: float) -> list[float]:
    """The loop without DeepSpeed, one process: the loss of every micro-batch; each update
    from the mean gradient of `ga` micro-batches."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for i, batch in enumerate(_loader()):
        if i >= STEPS * ga:
            break
        loss = model(input_ids=batch, labels=batch).loss
        (loss / ga).backward()
        losses.append(loss.item())
        if (i + 1) % ga == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad()
    return losses


def accelerate_losses(accelerator, ga: int) -> dict[str, Any]:
    """The Accelerate loop (module docstring) with `accelerator`, already made."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, _loader(), scheduler)
    losses = []
    for i, batch in enumerate(loader):
        if i >= STEPS * ga:
            break
        with accelerator.accumulate(model):
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    import deepspeed

    return {"losses": losses, "engine": isinstance(model, deepspeed.DeepSpeedEngine),
            "stage": model.zero_optimization_stage() if hasattr(model, "zero_optimization_stage") else None,
            "num_processes": accelerator.num_processes, "global_steps": getattr(model, "global_steps", None)}


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    unset_hf_deepspeed_config()


def plugin_cases(alias_dir: str, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))` for each config,
    in this pool worker (torchrun's environment), then the reference."""
    use_alias(alias_dir)
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    results = []
    for config in cases:
        _reset_accelerate()
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        ga = config.get("gradient_accumulation_steps", 1)
        plugin = DeepSpeedPlugin(hf_ds_config=json.loads(json.dumps(config)))
        accelerator = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=ga)
        result = accelerate_losses(accelerator, ga)
        result["reference"] = reference_losses(ga, config.get("gradient_clipping", 1.0))
        results.append(result)
    _reset_accelerate()
    return results


def main() -> None:
    """Run under `accelerate launch --config_file ... accelerate_loop.py OUT.json`: the loop with
    the launcher's DeepSpeed plugin; rank 0 writes its losses and the reference's to OUT.json."""
    out = sys.argv[1]
    from accelerate import Accelerator

    accelerator = Accelerator()
    ga = accelerator.state.deepspeed_plugin.get_value("gradient_accumulation_steps")
    result = accelerate_losses(accelerator, ga)
    result["distributed_type"] = str(accelerator.distributed_type)
    result["world_size"] = torch.distributed.get_world_size()
    if accelerator.is_main_process:
        result["reference"] = reference_losses(ga, accelerator.state.deepspeed_plugin.get_value("gradient_clipping"))
        with open(out, "w") as f:
            json.dump(result, f)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
