"""A process group made before zeroshard runs, as Ray Train makes one before it calls your
training function (docs/cluster.md). zeroshard adopts the group it finds: no environment
variables, no second group; each rank writes only its own checkpoint files.

    python examples/cluster/preinitialized_group.py --nproc 2 --save-dir ckpt --steps 20

Here the processes and their gloo group are made with plain torch; ray_train.py is the same
training function under Ray Train.
"""

import argparse
import os
import socket
import sys

import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from train_preemptible import train  # noqa: E402


def worker(rank: int, world_size: int, port: int, config: str, save_dir: str, steps: int) -> None:
    # What the framework does before handing over: the group exists, no RANK/WORLD_SIZE set.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        train(config, save_dir, steps)
    finally:
        dist.destroy_process_group()  # the group's owner ends it (docs/launching.md)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=2)
    here = os.path.dirname(os.path.abspath(__file__))
    parser.add_argument("--deepspeed_config", default=os.path.join(here, "..", "configs", "zero2_fp32.json"))
    parser.add_argument("--save-dir", required=True)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args.nproc, port, args.deepspeed_config, args.save_dir, args.steps), nprocs=args.nproc)


if __name__ == "__main__":
    main()
