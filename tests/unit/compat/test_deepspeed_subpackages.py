"""`import zeroshard as deepspeed` then `deepspeed.utils.safe_get_full_grad(p)` (issue 30, item 3):
DeepSpeed's package has its subpackages as attributes right after `import deepspeed`; zeroshard's
are imported on first read (module `__getattr__`), so `import zeroshard` stays light and does not
import transformers. Checked in a fresh interpreter: sys.modules of this one is already full.

The subpackages are DeepSpeed 0.19.8's (`pkgutil.iter_modules(deepspeed.__path__)` in
/tmp/dsvenv) that zeroshard provides, plus `zero` (a package attribute in DeepSpeed too).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

PROVIDED = ["accelerator", "checkpoint", "comm", "launcher", "module_inject", "moe", "monitor", "ops", "runtime",
            "sequence", "utils", "zero"]
# DeepSpeed's other subpackages: no zeroshard counterpart (the migration guide's absent rows).
ABSENT = ["autotuning", "compression", "inference", "pipe", "profiling", "linear", "model_implementations", "nvme"]

_CHECK = """
import json, sys
import zeroshard as deepspeed
light = "transformers" not in sys.modules
before = {name for name in sys.modules if name.startswith("zeroshard.")}
provided, absent = json.loads(sys.argv[1])
lazy = [name for name in provided if "zeroshard." + name not in before]
same = all(getattr(deepspeed, name) is sys.modules["zeroshard." + name] for name in provided)
missing = []
for name in absent:
    try:
        getattr(deepspeed, name)
        missing.append(name)
    except AttributeError:
        pass
print(json.dumps({"light": light, "lazy": lazy, "same": same, "absent_found": missing,
                  "grad": deepspeed.utils.safe_get_full_grad.__name__,
                  "engine": deepspeed.DeepSpeedEngine.__name__}))
"""


def test_subpackages_are_lazy_attributes() -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(_CHECK), json.dumps([PROVIDED, ABSENT])],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["light"], "import zeroshard imported transformers"
    assert found["same"] and found["absent_found"] == []
    assert {"runtime", "module_inject", "launcher", "accelerator"} <= set(found["lazy"]), found["lazy"]
    assert found["grad"] == "safe_get_full_grad"
    assert found["engine"] == "Engine"
