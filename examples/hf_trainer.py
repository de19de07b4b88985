"""Train a small Llama with the Hugging Face Trainer on zeroshard: a Trainer script, unchanged.

Setup, once per environment (docs/hf-trainer.md):

    pip install -e .                          # zeroshard
    zeroshard install-deepspeed-alias         # `import deepspeed` is zeroshard from now on

Run (2 processes on CPU; on GPUs drop --use_cpu):

    torchrun --nproc_per_node 2 examples/hf_trainer.py \
        --deepspeed examples/configs/hf_trainer_zero3.json --use_cpu --output_dir hf_out --max_steps 20

Everything below is ordinary transformers code: the DeepSpeed config reaches zeroshard through
`--deepspeed`, as it would reach DeepSpeed. The model is built from a config (no download) and
trained byte-level on the source of Python's `textwrap` module, so the loss falls within a few
steps. At the end `trainer.save_model()` writes a model that `from_pretrained` loads.
"""

from __future__ import annotations

import inspect
import textwrap

import torch
from torch.utils.data import Dataset
from transformers import (
    HfArgumentParser,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

SEQ_LEN = 64


class SourceBytes(Dataset):
    """Byte-level windows of a standard-library module's source (every machine has it)."""

    def __init__(self, seq_len: int = SEQ_LEN) -> None:
        data = torch.tensor(list(inspect.getsource(textwrap).encode("utf-8")), dtype=torch.long)
        self.windows = data[: len(data) // seq_len * seq_len].view(-1, seq_len)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.windows[i], "labels": self.windows[i]}


class PrintLoss(TrainerCallback):
    """One line per logged step on the main process: `step N loss X`."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "loss" in logs:
            print(f"step {state.global_step} loss {logs['loss']:.4f}", flush=True)


def main() -> None:
    parser = HfArgumentParser(TrainingArguments)
    parser.set_defaults(
        output_dir="hf_trainer_out", per_device_train_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=3e-3, max_steps=20, logging_steps=1, save_strategy="no", report_to=[],
        dataloader_drop_last=True, disable_tqdm=True,
    )
    (args,) = parser.parse_args_into_dataclasses()
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ_LEN,
    )
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)
    trainer = Trainer(model=model, args=args, train_dataset=SourceBytes(), callbacks=[PrintLoss()])
    trainer.train()
    trainer.save_model()  # at ZeRO-3: the gathered weights (stage3_gather_16bit_weights_on_model_save)
    if trainer.is_world_process_zero():
        print(f"saved to {args.output_dir}")


if __name__ == "__main__":
    main()
