"""The README's training example: a DeepSpeed config, a model, a dataset and DeepSpeed's loop.

    python examples/quickstart.py                          # one process
    torchrun --nproc_per_node 2 examples/quickstart.py     # two processes, ZeRO stage 2

README.md shows the code below this docstring verbatim; tests/unit/compat/test_docs_examples.py
checks that and compares the printed losses with a plain PyTorch loop.
"""

import torch
from torch import nn

import zeroshard as deepspeed  # the whole port from DeepSpeed

config = {
    "train_micro_batch_size_per_gpu": 16,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
    "gradient_clipping": 1.0,
    "zero_optimization": {"stage": 2},
}
torch.manual_seed(0)  # every rank builds the same data and model
x = torch.randn(512, 8)
dataset = torch.utils.data.TensorDataset(x, x @ torch.randn(8, 1))
model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 1))

deepspeed.init_distributed()  # from torchrun's environment; nothing to do in one process
engine, optimizer, loader, scheduler = deepspeed.initialize(
    model=model, model_parameters=model.parameters(), config=config, training_data=dataset)
for x, y in loader:
    loss = nn.functional.mse_loss(engine(x.to(engine.device)), y.to(engine.device))
    engine.backward(loss)
    engine.step()
    if engine.global_rank == 0:
        print(f"step {engine.global_steps} loss {loss.item():.6f}")
