"""One rank of the `deepspeed` command: run the user's script as DeepSpeed's launcher does.

torchrun starts `python -m zeroshard.launch.deepspeed_rank [--module] [--no_python]
[--no_local_rank] SCRIPT ARGS...` once per device. This appends `--local_rank=$LOCAL_RANK`
after SCRIPT (before ARGS, where DeepSpeed's deepspeed/launcher/launch.py puts it) unless `--no_local_rank`, then
runs SCRIPT in this interpreter as `python SCRIPT` would (`__name__ == "__main__"`, `sys.argv[0]`
the script, its folder first on sys.path), a module as `python -m` would, or, with `--no_python`,
replaces this process with the program (same process id, so torchrun's signals reach it).
"""

from __future__ import annotations

import os
import runpy
import sys

FLAGS = ("--module", "--no_python", "--no_local_rank")


def split(argv: list[str]) -> tuple[set[str], str, list[str]]:
    """(flags, script, script arguments): the leading FLAGS, then SCRIPT and its arguments.

    No `--` separates them: torchrun's parser drops it from the worker's arguments.
    """
    cut = 0
    while cut < len(argv) and argv[cut] in FLAGS:
        cut += 1
    if cut == len(argv):
        raise SystemExit("zeroshard.launch.deepspeed_rank: usage: [--module] [--no_python] [--no_local_rank] "
                         "SCRIPT [ARGS...] (started by the `deepspeed` command)")
    return set(argv[:cut]), argv[cut], argv[cut + 1:]


def main(argv: list[str]) -> None:
    flags, script, script_args = split(argv)
    if "--no_local_rank" not in flags:
        script_args = [f"--local_rank={os.environ.get('LOCAL_RANK', '0')}", *script_args]
    if "--no_python" in flags:
        os.execvp(script, [script, *script_args])
    if "--module" in flags:
        sys.argv = [script, *script_args]  # run_module puts the module's file in argv[0], as `python -m`
        runpy.run_module(script, run_name="__main__", alter_sys=True)
        return
    sys.argv = [script, *script_args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # `python SCRIPT` puts its folder first
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
