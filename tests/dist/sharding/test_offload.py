"""ZeRO-Offload (zeroshard/sharding/offload.py) trains exactly like the engine without it.

Offload vs none x stages 1-3 x gradient_accumulation_steps {1, 4} x backward calls per
micro-step {1, 4} (the four backwards of one step bounded by set_gradient_accumulation_boundary:
DeepSpeed's offload dropped all but the last with accumulation 1), 3 steps, 2 ranks; stage 3
offloads the parameters too. The runs without offload are checked against the one-process
reference elsewhere (test_backward_styles.py, test_conformance.py); here offload must equal them.

Tolerances (the gradient path is the same code on both sides, so the gradients, the norm and
clipping are bitwise equal; what differs is the optimizer kernel: torch's fused CPU AdamW with
offload, the foreach AdamW without):
* fp32: masters within 1e-6 absolute after 3 steps (weights ~0.1, updates ~lr = 1e-2; the
  kernels differ in the last bit or two of fp32, ~1e-8 per step).
* bf16: masters within 1e-3 absolute. A last-bit master difference can round the bf16
  parameter the other way (one bf16 ulp, 2^-8 relative, ~5e-4 for the largest weights),
  which changes the next forward; AdamW's normalised update keeps what follows well below lr.
Both bounds are far below what a dropped backward costs (about 2 x lr = 2e-2 after one step,
DeepSpeed's bug). Measured on torch 2.13 CPU: 0 in both modes (the fused and foreach CPU
kernels agree bit for bit here); the bounds leave room for kernels that do not.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist.scenarios.common import Case
from tests.dist.scenarios.offload import (
    grad_changed_before_step,
    load_moved,
    modify_with_gathered_parameters,
    offload_vs_none,
    overflow_with_offload,
    repeated_step,
    resume_bitexact,
    save_for_moving,
    with_offload,
)

TOLERANCE = {"fp32": 1e-6, "bf16": 1e-3}
KEEP = ("master",)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[n].float() - b[n].float()).abs().max()) for n in a)


def matrix(mode: str) -> list[tuple[Case, int]]:
    cases = [
        (Case(stage=stage, mode=mode, micro=4, ga=ga, keep=KEEP), k)
        for stage in (1, 2, 3) for ga in (1, 4) for k in (1, 4)
    ]
    # no_sync for all micro-steps but the last (one reduction of the local sum).
    return cases + [(Case(stage=stage, mode=mode, micro=4, ga=4, keep=KEEP, style="no_sync"), 2) for stage in (1, 2, 3)]


@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_offload_equals_no_offload(dist_pool, mode):
    cases = matrix(mode)
    results = dist_pool(2).run(offload_vs_none, cases, timeout=600)[0]
    for (case, k), result in zip(cases, results, strict=True):
        none, off = result["none"], result["offload"]
        label = f"{case.label} backwards={k}"
        assert off["placement"] == ("host", "host" if case.stage == 3 else "device"), label
        assert off["optimizer"] == "DeepSpeedCPUAdam" and none["optimizer"] == "AdamW", label
        assert not any(off["master_is_param"]) or (case.stage == 3 and mode == "fp32"), label
        # The gradient path is shared: the global norm (hence clipping) is bitwise the same.
        assert off["norms"] == none["norms"], f"{label}: norms {off['norms']} vs {none['norms']}"
        for step in range(case.steps):
            diff = max_diff(off["master"][step], none["master"][step])
            assert diff <= TOLERANCE[mode], f"{label}: step {step + 1} masters differ by {diff:.3g}"
            mod = max_diff(off["module"][step], none["module"][step])
            assert mod <= TOLERANCE[mode], f"{label}: step {step + 1} module parameters differ by {mod:.3g}"
        # One landing buffer per flat, reused: the same bytes whatever the number of backwards.
        host = off["host_grad_bytes"]
        assert host[0] and host == [host[0]] * case.steps, f"{label}: host gradient bytes {host}"
    # Four backwards per step land in the same host buffers as one: no host accumulator.
    by_key = {(c.stage, c.ga, k): r for (c, k), r in zip(cases, results, strict=True) if c.style == "engine"}
    for stage in (1, 2, 3):
        host = {k: by_key[(stage, 1, k)]["offload"]["host_grad_bytes"][0] for k in (1, 4)}
        assert host[1] == host[4], f"stage {stage}: host bytes {host}"


def test_repeated_step_is_a_no_op(dist_pool):
    cases = [with_offload(Case(stage=s, ga=ga, keep=KEEP)) for s, ga in ((1, 1), (2, 4), (3, 1))]
    cases.append(Case(stage=2, keep=KEEP))  # without offload too
    results = dist_pool(2).run(repeated_step, cases, timeout=300)[0]
    for case, runs in zip(cases, results, strict=True):
        plain, repeat = runs["plain"], runs["repeat"]
        assert repeat["global_steps"] == plain["global_steps"] == [1, 2, 3], case.label
        assert repeat["micro_steps"] == plain["micro_steps"], case.label
        for step in range(case.steps):
            assert max_diff(repeat["master"][step], plain["master"][step]) == 0.0, case.label
            for key in ("exp_avg", "exp_avg_sq", "step"):
                got = {n: v for n, v in repeat["state"][step][key].items() if v is not None}
                want = {n: v for n, v in plain["state"][step][key].items() if v is not None}
                assert max_diff(got, want) == 0.0, f"{case.label}: {key} after step {step + 1}"
        steps = {float(v) for v in repeat["state"][-1]["step"].values() if v is not None}
        assert steps == {3.0}, f"{case.label}: AdamW step counts {steps} (bias correction)"


@pytest.mark.parametrize("mode", ["fp16", "bf16"])
def test_overflow_skip_with_offload(dist_pool, mode):
    cases = [Case(stage=s, mode=mode, keep=KEEP) for s in (1, 2, 3)]
    results = dist_pool(2).run(overflow_with_offload, cases, 1, timeout=300)[0]
    for case, runs in zip(cases, results, strict=True):
        none, off = runs["none"], runs["offload"]
        assert off["skipped"] == none["skipped"] == [0, 1, 1], f"{case.label}: {off['skipped']}"
        assert off["scale"] == none["scale"], case.label
        # The skipped step changed nothing: masters and AdamW state as after step 1.
        assert max_diff(off["master"][1], off["master"][0]) == 0.0, case.label
        for key in ("exp_avg", "exp_avg_sq", "step"):
            s0 = {n: v for n, v in off["state"][0][key].items() if v is not None}
            s1 = {n: v for n, v in off["state"][1][key].items() if v is not None}
            assert max_diff(s0, s1) == 0.0, f"{case.label}: {key} moved on the skipped step"
        for step in range(case.steps):
            diff = max_diff(off["master"][step], none["master"][step])
            assert diff <= TOLERANCE["bf16"], f"{case.label}: step {step + 1} masters differ by {diff:.3g}"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offloaded_resume_is_bitexact(dist_pool, tmp_path, stage):
    case = with_offload(Case(stage=stage, mode="bf16", steps=4, keep=KEEP))
    dist_pool(2).run(resume_bitexact, case, str(tmp_path), timeout=300)


@pytest.mark.parametrize(
    "saved, loaded, load_world",
    [
        (with_offload(Case(stage=2, mode="bf16")), Case(stage=2, mode="bf16"), 2),
        (Case(stage=1, mode="bf16"), with_offload(Case(stage=3, mode="bf16")), 2),
        (with_offload(Case(stage=3, mode="fp32")), Case(stage=1, mode="fp32"), 1),
        (Case(stage=2, mode="fp32"), with_offload(Case(stage=2, mode="fp32")), 1),
    ],
    ids=["offload-to-none", "none-to-offload-stage3", "offload-to-none-world1", "none-to-offload-world1"],
)
def test_checkpoint_moves_between_offload_settings(dist_pool, tmp_path, saved, loaded, load_world):
    want = dist_pool(2).run(save_for_moving, saved, str(tmp_path), timeout=300)[0]
    got = dist_pool(load_world).run(load_moved, loaded, str(tmp_path), timeout=300)[0]
    assert got["placement"] == ("host" if "offload" in loaded.variant else "device")
    # Masters and AdamW state arrive exactly; the module parameters are the masters in their dtype.
    assert max_diff(got["master"], want["master"]) == 0.0
    for key in ("exp_avg", "exp_avg_sq", "step"):
        g = {n: v for n, v in got["state"][key].items() if v is not None}
        w = {n: v for n, v in want["state"][key].items() if v is not None}
        assert g.keys() == w.keys() and max_diff(g, w) == 0.0, key
    dtype = next(iter(got["module"].values())).dtype
    for name, value in got["module"].items():
        torch.testing.assert_close(value, want["master"][name].to(dtype), rtol=0, atol=0)


MUON = {"optimizer": {"type": "Muon", "params": {
    "muon_lr": 0.02, "adam_lr": 1e-2, "momentum": 0.95, "weight_decay": 0.1, "betas": [0.9, 0.999], "eps": 1e-8,
    "ns_method": "gram",
}}}


def test_muon_with_offload_equals_no_offload(dist_pool):
    """Muon's Newton-Schulz runs on the host masters (fp32, the matrices this rank owns); the
    same gradients give the same update as on the device masters, so the fp32 bound holds."""
    cases = [(Case(stage=stage, micro=4, ga=1, keep=KEEP, extra=MUON), k) for stage in (1, 2, 3) for k in (1, 4)]
    results = dist_pool(2).run(offload_vs_none, cases, timeout=600)[0]
    for (case, k), result in zip(cases, results, strict=True):
        none, off = result["none"], result["offload"]
        assert off["optimizer"] == none["optimizer"] == "ShardedMuon", off["optimizer"]
        assert off["master_devices"] == ["cpu"] and off["placement"][0] == "host"
        for step in range(case.steps):
            diff = max_diff(off["master"][step], none["master"][step])
            assert diff <= TOLERANCE["fp32"], f"{case.label} backwards={k}: step {step + 1} differs by {diff:.3g}"


BF16_MASTER = {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}
BF16_MASTER_STATE = {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}}
# bf16 masters: one bf16 ulp of the largest weights (2^-7 relative) on top of the bf16 bound.
BF16_MASTER_TOLERANCE = {"atol": 1e-3, "rtol": 2**-7}


def bf16_master_cases(world_size: int) -> list[tuple[str, Case, int]]:
    cases = [
        (label, Case(stage=stage, mode="bf16", micro=4, keep=KEEP, extra=extra), k)
        for stage in (1, 2, 3)
        for label, extra, k in (("bf16 masters, fp32 state", BF16_MASTER, 4),
                                ("bf16 masters and state", BF16_MASTER_STATE, 1))
    ]
    muon = Case(stage=2, mode="bf16", micro=4, keep=KEEP, extra={**BF16_MASTER, **MUON})
    cases.append(("bf16 masters, Muon", muon, 4))
    if world_size == 1:  # world 2 is test_muon_with_offload_equals_no_offload
        cases += [("fp32 Muon", Case(stage=s, micro=4, keep=KEEP, extra=MUON), 4) for s in (1, 2, 3)]
    return cases


@pytest.mark.parametrize("world_size", [1, 2])
def test_bf16_master_weights_and_muon_with_offload(dist_pool, world_size):
    """bf16.bf16_master_weights_and_grads (with and without bf16_optimizer_states) and Muon
    with offload_optimizer: the host keeps bf16 masters (and the state in the dtype the plan
    says), steps them on the CPU, and trains as the engine without offload. Newton-Schulz
    runs on the host in fp32 for the matrices this rank owns. Measured on torch 2.13 CPU: 0
    difference in every case (the same kernels run on the same device here)."""
    cases = bf16_master_cases(world_size)
    results = dist_pool(world_size).run(offload_vs_none, [(c, k) for _, c, k in cases], timeout=600)[0]
    for (label, case, k), result in zip(cases, results, strict=True):
        none, off = result["none"], result["offload"]
        where = f"W={world_size} {case.label} {label} backwards={k}"
        assert off["master_devices"] == ["cpu"] and off["placement"][0] == "host", where
        assert off["master_dtypes"] == none["master_dtypes"], where
        assert off["state_dtypes"] == none["state_dtypes"], where
        if "bf16 masters" in label:
            assert off["master_dtypes"] == ["torch.bfloat16"], where
            state = "torch.bfloat16" if "and state" in label else "torch.float32"
            assert off["state_dtypes"] == [state], f"{where}: {off['state_dtypes']}"
        assert off["norms"] == none["norms"], f"{where}: norms {off['norms']} vs {none['norms']}"
        tol = BF16_MASTER_TOLERANCE if case.mode == "bf16" else {"atol": TOLERANCE["fp32"], "rtol": 0}
        for step in range(case.steps):
            for name, value in off["master"][step].items():
                torch.testing.assert_close(value.float(), none["master"][step][name].float(), **tol,
                                           msg=lambda m, n=name, s=step, w=where: f"{w} step {s + 1} {n}: {m}")


def test_gathered_parameters_modifier_writes_the_host_master(dist_pool):
    """A change made inside GatheredParameters(modifier_rank=0) reaches the offloaded
    (host) master exactly, and leaves every other master bitwise as it was."""
    cases = [with_offload(Case(stage=s, mode=m, steps=1, keep=KEEP)) for s in (1, 2, 3) for m in ("fp32", "bf16")]
    results = dist_pool(2).run(modify_with_gathered_parameters, cases, timeout=300)[0]
    for case, result in zip(cases, results, strict=True):
        for name, before in result["before"].items():
            after = result["after"][name]
            if name == "blocks.0.fc.weight":
                assert torch.equal(after, torch.full_like(after, 0.5)), f"{case.label}: {name} not written"
                assert torch.equal(result["module"][name].float(), after), case.label
            else:
                assert torch.equal(after, before), f"{case.label}: {name} changed"


def test_other_precision_modes_with_offload(dist_pool):
    """fp16 (dynamic loss scale), torch_autocast(bf16) (fp32 parameters: the master is a host
    copy of its own) and bf16 accumulation, stages 1-3, four backwards per step: offload
    trains as the engine without it, within the bf16 bound (what these modes round is
    identical on both sides; only the optimizer kernel differs)."""
    modes = ("fp16", "autocast_bf16", "bf16_accum_bf16")
    cases = [(Case(stage=s, mode=m, micro=4, ga=1, keep=KEEP), 4) for m in modes for s in (1, 2, 3)]
    results = dist_pool(2).run(offload_vs_none, cases, timeout=600)[0]
    for (case, _k), result in zip(cases, results, strict=True):
        none, off = result["none"], result["offload"]
        assert off["norms"] == none["norms"], f"{case.label}: norms {off['norms']} vs {none['norms']}"
        for step in range(case.steps):
            diff = max_diff(off["master"][step], none["master"][step])
            assert diff <= TOLERANCE["bf16"], f"{case.label}: step {step + 1} masters differ by {diff:.3g}"


SMALL_BUCKETS = {"zero_optimization": {"reduce_bucket_size": 40}}  # flats span several buckets


def test_gradient_lands_on_the_host_bucket_by_bucket(dist_pool):
    """The boundary backward's reduced shards go to the host piece by piece as each bucket's
    reduction completes ([Note: landing bucket by bucket] in zeroshard/sharding/offload.py): with
    buckets smaller than a flat, several backwards per step, accumulation 4 and no_sync, every
    flat's gradient is taken from the landed buffer at every step, never moved whole, and the
    masters equal the run without offload bit for bit (fp32 and bf16; on CPU both paths run
    the same kernels, so any difference would be a landing bug: a missed or stale piece)."""
    styles = ((1, 4, "engine"), (4, 1, "engine"), (4, 2, "no_sync"))
    cases = [
        (Case(stage=stage, mode=mode, micro=4, ga=ga, keep=KEEP, style=style, extra=SMALL_BUCKETS), k)
        for stage, mode in ((1, "fp32"), (2, "fp32"), (3, "fp32"), (2, "bf16")) for ga, k, style in styles
    ]
    results = dist_pool(2).run(offload_vs_none, cases, timeout=600)[0]
    for (case, k), result in zip(cases, results, strict=True):
        none, off = result["none"], result["offload"]
        label = f"{case.label} backwards={k}"
        assert off["host_moves"] == {"landed": off["flats"] * case.steps, "whole": 0}, f"{label}: {off['host_moves']}"
        assert off["norms"] == none["norms"], label
        for step in range(case.steps):
            assert max_diff(off["master"][step], none["master"][step]) == 0.0, f"{label}: step {step + 1}"


def test_gradient_changed_after_landing_moves_again(dist_pool):
    """safe_set_full_grad between the boundary backward and the step changes a landed
    gradient: that flat moves whole at the step (the others still landed), and training
    equals the run without offload with the same change."""
    cases = [Case(stage=stage, keep=KEEP, extra=SMALL_BUCKETS) for stage in (1, 2, 3)]
    results = dist_pool(2).run(grad_changed_before_step, cases, timeout=300)[0]
    for case, runs in zip(cases, results, strict=True):
        moves = runs["offload"]["host_moves"]
        assert moves["whole"] == case.steps and moves["landed"] > 0, f"{case.label}: {moves}"
        for step in range(case.steps):
            diff = max_diff(runs["offload"]["master"][step], runs["none"]["master"][step])
            assert diff == 0.0, f"{case.label}: step {step + 1} differs by {diff:.3g}"
