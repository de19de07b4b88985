"""engine.compile(): the demo GPT's blocks compiled one by one, at ZeRO stage 3 (docs/compile.md).

    python examples/compile_blocks.py                                  # inductor
    python examples/compile_blocks.py --backend aot_eager              # eager kernels, the same bits
    torchrun --nproc_per_node 2 examples/compile_blocks.py --backend aot_eager

Prints each compiled region (one graph per block, no break) and the losses;
tests/unit/compat/test_docs_examples.py compares them with a plain PyTorch loop.
"""

import argparse

import torch

import zeroshard
from zeroshard.models import build_gpt

parser = argparse.ArgumentParser()
parser.add_argument("--backend", default="inductor")
parser.add_argument("--steps", type=int, default=4)
args = parser.parse_args()

config = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}
torch.manual_seed(0)
model = build_gpt("tiny", n_layer=2, n_embd=32, block_size=16)

zeroshard.init_distributed()
engine, *_ = zeroshard.initialize(model=model, config=config)
engine.compile(backend=args.backend)  # DeepSpeed's call; the Trainer's torch_compile=True makes it too
for region in engine.compiled_regions:
    print(f"compiled {region.name}: one graph {region.fullgraph}, eager parts {region.eager_parts}")

data = torch.Generator().manual_seed(1)
for _ in range(args.steps):
    idx = torch.randint(0, 256, (2, 16), generator=data)
    _, loss = engine(idx, idx)
    engine.backward(loss)
    engine.step()
    if engine.global_rank == 0:
        print(f"step {engine.global_steps} loss {loss.item():.6f}")
