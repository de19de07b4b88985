"""Per-head Muon on a custom attention model, ZeRO-3, 2 processes (docs/muon.md).

    zeroshard launch --nproc 2 examples/muon_per_head.py --steps 20
    zeroshard explain examples/configs/zero3_muon_per_head.json --model examples.muon_per_head:TinyLM

A model that is not one of the Hugging Face families with a preset says where its heads are
with parameter attributes (the config's `per_head_muon` turns on the presets, and is refused for
a model that has neither a preset nor attributes): `muon_num_heads` (DeepSpeed's name; the query, key and value
projections, heads on the rows) and `muon_head_axis = 1` for the output projection (heads on
its input columns). The key/value projections have fewer heads (grouped-query attention). The
Conv1d mixing layer is one [out, in * kernel] matrix (not marked as an expert stack). Each rank
prints nothing but rank 0, which prints how Muon cuts each weight, then the loss per step.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import zeroshard
from zeroshard.optim.muon.optimizer import muon_param_plan

VOCAB, DIM, HEADS, KV_HEADS, SEQ = 64, 32, 4, 2, 16
HEAD_DIM = DIM // HEADS


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.k = nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False)
        self.v = nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False)
        self.o = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)
        self.q.weight.muon_num_heads = HEADS
        self.k.weight.muon_num_heads = KV_HEADS
        self.v.weight.muon_num_heads = KV_HEADS
        self.o.weight.muon_num_heads = HEADS
        self.o.weight.muon_head_axis = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, HEADS, HEAD_DIM).transpose(1, 2)
        k = self.k(x).view(b, t, KV_HEADS, HEAD_DIM).transpose(1, 2).repeat_interleave(HEADS // KV_HEADS, dim=1)
        v = self.v(x).view(b, t, KV_HEADS, HEAD_DIM).transpose(1, 2).repeat_interleave(HEADS // KV_HEADS, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, DIM))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = Attention()
        self.mix = nn.Conv1d(DIM, DIM, kernel_size=3, padding=2)  # causal: the last 2 outputs are cut
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = h + self.attn(self.norm1(h))
        h = h + self.mix(self.norm2(h).transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)
        return F.cross_entropy(self.lm_head(h).reshape(-1, VOCAB), y.reshape(-1))


CONFIG = json.loads((Path(__file__).parent / "configs" / "zero3_muon_per_head.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    zeroshard.init_distributed()
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = TinyLM()
    if rank == 0:
        for choice in muon_param_plan(model, CONFIG["optimizer"]["params"]):
            print(f"{choice.name:18} {'Muon ' if choice.use_muon else 'AdamW'} {choice.reason}")
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=CONFIG)
    # A fixed pattern to learn: each token is followed by (token * 5 + 1) mod VOCAB.
    gen = torch.Generator().manual_seed(rank)
    for step in range(1, args.steps + 1):
        start = torch.randint(0, VOCAB, (CONFIG["train_micro_batch_size_per_gpu"], 1), generator=gen)
        seq = [start]
        for _ in range(SEQ):
            seq.append((seq[-1] * 5 + 1) % VOCAB)
        tokens = torch.cat(seq, dim=1)
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        if rank == 0:
            print(f"step {step:3d} loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
