"""A rank that skips one step(): the hang watchdog names it on every rank (docs/reliability.md).

    torchrun --standalone --nproc_per_node=2 examples/hang_diagnosis.py

Rank 1 skips `engine.step()` once, as a loop that catches an error and `continue`s would. Its
next backward's gradient reduction then meets rank 0's optimizer step: before zeroshard's hang
watchdog, gloo aborted both processes ("Received data size doesn't match expected size") with no
Python error. Now both ranks wait on different transports, and within a few seconds each raises
`HangError` with the same diagnosis, which rank 0 prints here. The process group cannot be used
after that, so the script ends (zeroshard leaves with status 1).
"""

import torch
import torch.nn.functional as F

import zeroshard
from zeroshard.comm.faults import HangError

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
config = {
    "train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 2},
    # Seconds for the example; the defaults are 300 and 600.
    "zeroshard": {"hang_timeout_s": 3, "collective_timeout_s": 30},
}
engine, _, _, _ = zeroshard.initialize(model=model, config=config)
rank = torch.distributed.get_rank()
try:
    for step in range(4):
        x = torch.randn(4, 8)
        loss = F.mse_loss(engine(x), x.sum(dim=1, keepdim=True))
        engine.backward(loss)
        if rank == 1 and step == 1:
            continue  # the bug: this rank skips one optimizer step
        engine.step()
except HangError as error:
    if rank == 0:
        print(error.diagnosis)
