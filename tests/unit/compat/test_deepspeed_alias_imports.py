"""Every `deepspeed.*` module path and name that the pinned transformers (5.23.0), Accelerate
(1.15.0) and TRL (1.16.0) import or read resolves through the `deepspeed` alias (issue 24,
item 1), to the very zeroshard object.

The list was made by grepping their installed sources for `import deepspeed`, `from deepspeed...
import` and `deepspeed.X.Y` (file:line below, in site-packages). Names an integration reads only
for a feature zeroshard does not have are in NOT_PROVIDED with the reason; the ZeRO-3 loading
internals (`partition_parameters.zero_wrapper_for_fp_tensor_constructor`, `_orig_torch_arange`,
`get_accelerator`; transformers/integrations/deepspeed.py:786-801) and
`deepspeed.zero.register_external_parameter` (the speech models' `modeling_*.py`) belong to the
`from_pretrained` under ZeRO-3 work and are not checked here.

One subprocess (the alias changes sys.modules and sys.meta_path) checks what `import deepspeed`
gives (find_spec, the installed version, the zeroshard module with its own spec), the whole list,
that no zeroshard module is loaded a second time under the deepspeed name, and that transformers
and Accelerate detect DeepSpeed through the alias and read its version as 0.19.8.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from zeroshard.tools.deepspeed_alias import install

REPO = Path(__file__).resolve().parents[3]

# (module path, names read from it, where found)
IMPORTS = [
    ("deepspeed", ["DeepSpeedEngine"], "accelerate/utils/other.py:310"),
    ("deepspeed", ["comm"], "accelerate/state.py:209"),
    ("deepspeed", ["initialize"], "accelerate/accelerator.py:2144, trl/models/utils.py:287"),
    ("deepspeed", ["zero"], "transformers/modeling_utils.py:1446, trl/distributed.py:68"),
    ("deepspeed", ["__version__"], "transformers/cli/system.py:108"),
    ("deepspeed.zero", ["Init", "GatheredParameters"], "transformers/modeling_utils.py:1446, 4911"),
    ("deepspeed.comm", ["is_initialized", "init_distributed"], "accelerate/state.py:211, 215"),
    ("deepspeed.comm", ["get_rank"], "transformers/integrations/deepspeed.py:327, trl/trainer/callbacks.py:143"),
    ("deepspeed.accelerator", ["get_accelerator"], "transformers/integrations/deepspeed.py:504"),
    ("deepspeed.checkpoint.utils", ["clone_tensors_for_torch_save"], "accelerate/accelerator.py:4093"),
    ("deepspeed.launcher.runner", ["DEEPSPEED_ENVIRONMENT_NAME"], "accelerate/commands/launch.py:1045"),
    ("deepspeed.ops.adam", ["DeepSpeedCPUAdam"], "accelerate/utils/deepspeed.py:41"),
    ("deepspeed.runtime.engine", ["DeepSpeedEngine"], "trl/models/utils.py:47"),
    ("deepspeed.runtime.lr_schedules", ["VALID_LR_SCHEDULES"], "accelerate/accelerator.py:2246, 2386, 2477"),
    ("deepspeed.runtime.sequence_parallel.ulysses_sp", ["UlyssesSPAttentionHF", "UlyssesSPDataLoaderAdapter"],
     "accelerate/accelerator.py:2407, 2502"),
    ("deepspeed.runtime.zero", ["partition_parameters"], "transformers/integrations/deepspeed.py:784"),
    ("deepspeed.runtime.zero.partition_parameters", ["ZeroParamStatus"], "trl/trainer/utils.py:226"),
    ("deepspeed.utils", ["groups"], "accelerate/accelerator.py:2503, transformers/integrations/deepspeed.py:751"),
    ("deepspeed.utils.groups", ["_get_sequence_parallel_group", "_get_sequence_parallel_world_size",
                                "_get_sequence_parallel_rank"], "accelerate/accelerator.py:2505-2507"),
    ("deepspeed.utils", ["logger"], "transformers/integrations/deepspeed.py:634"),
    ("deepspeed.utils", ["set_z3_leaf_modules"], "accelerate/utils/dataclasses.py:1540"),
    ("deepspeed.runtime.utils", ["move_to_device"],
     "accelerate/test_utils/scripts/external_deps/test_ds_alst_ulysses_sp.py:20"),
    # Not imported by the three packages but named by issue 24 as paths users' scripts take.
    ("deepspeed.utils.zero_to_fp32", [], "issue 24 (DeepSpeed's consolidation script's module)"),
    ("deepspeed.sequence.layer", ["DistributedAttention"], "issue 24 (Ulysses attention)"),
    ("deepspeed.ops.adagrad", ["DeepSpeedCPUAdagrad"], "accelerate/utils/deepspeed.py:79"),
    # AutoTP's rules and layers by DeepSpeed 0.19.8's module paths (docs/tensor-parallel.md).
    ("deepspeed.module_inject.autotp_config", ["TPLayerSpec", "AutoTPConfig", "AutoTPPresets", "PartitionType"],
     "issue 41 (AutoTP rules)"),
    ("deepspeed.module_inject.layers", ["LinearLayer", "LinearAllreduce"], "issue 41 (AutoTP layers)"),
    ("deepspeed.utils.groups", ["get_tensor_model_parallel_group", "get_tensor_model_parallel_world_size",
                                "get_tensor_model_parallel_rank", "get_data_parallel_group", "_init_tp_mesh_device"],
     "issue 41 (the tensor-parallel getters AutoTP code calls)"),
]

# Dotted names read as attributes after a bare `import deepspeed` (no import of the submodule):
# (name, where found). DeepSpeed's `import deepspeed` imports these submodules along the way.
ATTRIBUTE_READS = [
    ("deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES", "accelerate/accelerator.py:2246"),
    ("deepspeed.zero.Init", "transformers/modeling_utils.py:1446"),
    ("deepspeed.zero.GatheredParameters", "transformers/modeling_utils.py:4911"),
    ("deepspeed.comm.get_rank", "transformers/integrations/deepspeed.py:327"),
    ("deepspeed.initialize", "accelerate/accelerator.py:2144"),
    ("deepspeed.__version__", "transformers/cli/system.py:108"),
    ("deepspeed.runtime.zero.GatheredParameters", "accelerate/utils/operations.py:975"),
    ("deepspeed.runtime.engine.DeepSpeedEngine", "accelerate/utils/deepspeed.py:255"),
    ("deepspeed.tp_model_init", "transformers/integrations/deepspeed.py:663"),
]

# (path, where found, why zeroshard refuses it): the import raises ModuleNotFoundError naming
# the path and what to do instead.
REFUSED = [
    ("deepspeed.ops.lion", "accelerate/utils/deepspeed.py:93", "no host Lion: offload trains Adam/AdamW"),
]

# (name, where found, why absent)
NOT_PROVIDED = [
    ("deepspeed.utils.is_initialized", "transformers/models/esm/modeling_esmfold.py:155",
     "DeepSpeed 0.19 has no such name either"),
]

_CHECK = """
import importlib, importlib.metadata, importlib.util, json, sys
problems = []
spec = importlib.util.find_spec("deepspeed")  # before the import: the alias package on sys.path
if spec is None or not spec.origin.endswith("deepspeed/__init__.py"):
    problems.append(f"find_spec('deepspeed') before the import: {spec}")
if importlib.metadata.version("deepspeed") != "0.19.8+zeroshard":
    problems.append("version " + importlib.metadata.version("deepspeed"))
import deepspeed
import zeroshard as _zeroshard
if deepspeed is not _zeroshard or deepspeed.__spec__.name != "zeroshard" or not importlib.util.find_spec("deepspeed"):
    problems.append("import deepspeed is not the zeroshard module with its own spec")
imports, refused, not_provided, attribute_reads = json.loads(sys.argv[1])
for dotted, where in attribute_reads:  # first, before anything below imports a submodule
    obj = deepspeed
    try:
        for part in dotted.split(".")[1:]:
            obj = getattr(obj, part)
    except AttributeError as exc:
        problems.append(f"{dotted} ({where}), read as an attribute: {exc}")
import zeroshard
for path, names, where in imports:
    try:
        module = importlib.import_module(path)
    except Exception as exc:
        problems.append(f"{path} ({where}): {type(exc).__name__}: {exc}")
        continue
    twin = importlib.import_module("zeroshard" + path[len("deepspeed"):])
    if module is not twin or module.__spec__.name != twin.__name__:  # the spec is the module's own
        problems.append(f"{path} is not {twin.__name__}")
    __import__(path, fromlist=names)  # `from path import name` also imports a submodule `name`
    for name in names:
        if not hasattr(module, name):
            problems.append(f"{path}.{name} ({where}): missing")
for path, where, why in refused:
    try:
        importlib.import_module(path)
        problems.append(f"{path} ({where}) imported; expected a refusal ({why})")
    except ModuleNotFoundError as exc:
        if exc.name != path or "does not provide " + path not in str(exc) or "offload_optimizer" not in str(exc):
            problems.append(f"{path}: unclear refusal: {exc}")
for dotted, where, why in not_provided:
    module, _, name = dotted.rpartition(".")
    if hasattr(importlib.import_module(module), name):
        problems.append(f"{dotted} ({where}) now exists: move it to IMPORTS")
doubles = [n for n, m in sys.modules.items() if n.startswith("deepspeed.")
           and m is not sys.modules.get("zeroshard" + n[len("deepspeed"):])]
problems += [f"{n}: a second copy of a zeroshard module" for n in doubles]
# How the integrations detect DeepSpeed (find_spec, then the installed version).
from accelerate.utils import compare_versions, is_deepspeed_available as accelerate_has_deepspeed
from transformers.integrations.deepspeed import is_deepspeed_available as transformers_has_deepspeed
if not (accelerate_has_deepspeed() and transformers_has_deepspeed()):
    problems.append("transformers or accelerate does not find deepspeed")
for minimum in ("0.9.3", "0.14.4", "0.16.4", "0.18.2", "0.19.8"):  # accelerate/accelerator.py's checks
    if not compare_versions("deepspeed", ">=", minimum):
        problems.append(f"accelerate reads the alias's version as below {minimum}")
print(json.dumps(problems))
"""


@pytest.fixture(scope="module")
def alias_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("alias")
    install(target)
    return target


def test_every_integration_import_resolves_to_zeroshard(alias_dir: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(alias_dir), str(REPO)]))
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_CHECK), json.dumps([IMPORTS, REFUSED, NOT_PROVIDED, ATTRIBUTE_READS])],
        env=env, capture_output=True, text=True, timeout=180, cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    problems = json.loads(result.stdout.strip().splitlines()[-1])
    assert problems == [], "\n".join(problems)


def test_the_list_names_where_each_was_found() -> None:
    site = Path(sys.modules["pytest"].__file__).parents[1]  # site-packages of this environment
    reads = [(d.rsplit(".", 1)[0], [], w) for d, w in ATTRIBUTE_READS]
    for path, _, where in IMPORTS + [(p, [], w) for p, w, _ in REFUSED] + reads:
        if where.startswith("issue"):
            continue
        first = where.split(",")[0]
        file, line = first.rsplit(":", 1)
        text = (site / file).read_text(encoding="utf-8").splitlines()
        start = int(line.split("-")[0])
        window = "\n".join(text[start - 3:start + 3])
        leaf = path.split(".")[-1]
        assert "deepspeed" in window and (leaf in window or path == "deepspeed"), f"{path}: not at {first}"
