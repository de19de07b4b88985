"""The one workload every engine in the peer benchmark trains: model, data, optimizer, modes.

Every engine gets the same GPT (the demo's model at a preset size, initialised from one seed),
the same synthetic byte text, the same batches (rank r of step s always reads the same
windows), AdamW with the same hyper-parameters, and gradient clipping at 1.0. Only the way the
step is distributed differs.

[Note: precision modes]
A mode names what the step computes in, as each engine spells it:

    fp32      everything fp32.
    bf16      parameters and compute in bf16. zeroshard and DeepSpeed keep fp32 master weights
              and optimizer state; FSDP2 keeps fp32 sharded parameters and casts to bf16 for
              compute (MixedPrecisionPolicy); DDP and the floor simply hold the model in bf16
              (no master copy, so it is the cheapest and least accurate recipe).
    autocast  fp32 parameters, compute under torch.autocast(bf16).
    fp16      fp16 parameters and compute with fp32 masters and a dynamic loss scale
              (zeroshard, DeepSpeed only; slow on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zeroshard.models import GPT, PRESETS, build_gpt

MODES = ("fp32", "bf16", "autocast", "fp16")
LEARNING_RATE = 1e-3
ADAMW_KWARGS = {"lr": LEARNING_RATE, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
GRADIENT_CLIPPING = 1.0

# Synthetic text: words drawn (Zipf-like) from a fixed vocabulary of random lowercase words, so
# the model has structure to learn within a few steps and the loss curve means something.
_TEXT_BYTES = 1 << 18
_VOCAB_WORDS = 512


@dataclass(frozen=True)
class Workload:
    """What one benchmark run trains.

    Attributes:
        preset: the demo model preset (`zeroshard.models.gpt.PRESETS`).
        world_size: data-parallel ranks W.
        global_batch: sequences per optimizer step over all ranks.
        steps: optimizer steps timed and reported (after `warmup`).
        warmup: steps run first and left out of the timing.
        seed: seeds the model init, the text and the batch order.
        optimizer: "adamw" (every engine) or "muon" (zeroshard only; AdamW for the rest of its
            parameters, as Muon does).
    """

    preset: str
    world_size: int
    global_batch: int
    steps: int
    warmup: int
    seed: int = 1234
    optimizer: str = "adamw"

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"--model {self.preset}: unknown preset; use one of {', '.join(PRESETS)}.")
        if self.global_batch % self.world_size:
            raise ValueError(
                f"--global-batch {self.global_batch} is not divisible by --world-size {self.world_size}: "
                "every rank needs the same micro-batch. Pick a multiple of the world size."
            )

    @property
    def micro_batch(self) -> int:
        """Sequences per rank per step (the floor trains this on one process)."""
        return self.global_batch // self.world_size

    @property
    def seq_len(self) -> int:
        return PRESETS[self.preset].block_size

    @property
    def tokens_per_step(self) -> int:
        """Tokens one optimizer step consumes over all ranks."""
        return self.global_batch * self.seq_len

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps


def build_model(workload: Workload) -> GPT:
    """The fp32 model, identical on every rank and for every engine."""
    torch.manual_seed(workload.seed)
    return build_gpt(workload.preset)


def synthetic_text(seed: int) -> torch.Tensor:
    """A deterministic uint8 byte stream of lowercase words separated by spaces."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 9, (_VOCAB_WORDS,), generator=gen)
    letters = torch.randint(ord("a"), ord("z") + 1, (int(lengths.sum()),), generator=gen, dtype=torch.uint8)
    words = [bytes(w.tolist()) for w in torch.split(letters, lengths.tolist())]
    # Zipf-like word frequencies: word k is drawn with weight 1 / (k + 1).
    weights = 1.0 / torch.arange(1, _VOCAB_WORDS + 1, dtype=torch.float64)
    picks = torch.multinomial(weights, _TEXT_BYTES // 4, replacement=True, generator=gen)
    text = b" ".join(words[i] for i in picks.tolist())[:_TEXT_BYTES]
    return torch.frombuffer(bytearray(text), dtype=torch.uint8)


class BatchPlan:
    """Which text windows rank r reads at step s: the same for every engine and run."""

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        self.text = synthetic_text(workload.seed)  # uint8: 256 KiB, widened per batch
        gen = torch.Generator().manual_seed(workload.seed + 1)
        high = self.text.numel() - workload.seq_len - 1
        self.offsets = torch.randint(0, high, (workload.total_steps, workload.global_batch), generator=gen)

    def batch(self, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, next-byte targets), each (micro_batch, seq_len) int64."""
        mb, t = self.workload.micro_batch, self.workload.seq_len
        starts = self.offsets[step, rank * mb : (rank + 1) * mb]
        index = starts[:, None] + torch.arange(t + 1)[None, :]
        windows = self.text[index].long()
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
