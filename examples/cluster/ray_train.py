"""Ray Train: the training function of train_preemptible.py on Ray workers (docs/cluster.md).
Not run by the tests (Ray is not installed where they run); preinitialized_group.py is the
same situation in plain torch, and is.

    python examples/cluster/ray_train.py --workers 4 --save-dir /shared/ckpt --steps 1000

Ray creates the process group before the function runs; zeroshard adopts it. Ray restarts the
workers after a node failure (FailureConfig.max_failures); the function then resumes from the
newest complete checkpoint in --save-dir (a directory every worker sees). Ray runs the function
in a thread of its worker process, where Python cannot install signal handlers, so zeroshard
logs that none were installed: Ray's own fault handling is what stops and restarts the run.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from train_preemptible import train  # noqa: E402


def main() -> None:
    import ray.train
    from ray.train.torch import TorchTrainer

    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--gpu", action="store_true")
    here = os.path.dirname(os.path.abspath(__file__))
    parser.add_argument("--deepspeed_config", default=os.path.join(here, "..", "configs", "zero2_fp32.json"))
    parser.add_argument("--save-dir", required=True)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    trainer = TorchTrainer(
        lambda cfg: train(cfg["config"], cfg["save_dir"], cfg["steps"]),
        train_loop_config={"config": os.path.abspath(args.deepspeed_config),
                           "save_dir": os.path.abspath(args.save_dir), "steps": args.steps},
        scaling_config=ray.train.ScalingConfig(num_workers=args.workers, use_gpu=args.gpu),
        run_config=ray.train.RunConfig(failure_config=ray.train.FailureConfig(max_failures=10)),
    )
    trainer.fit()


if __name__ == "__main__":
    main()
