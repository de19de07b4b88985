"""tests/dist/reference.py's `device` argument: the CPU default is unchanged (every CPU caller
passes none), the result is always on the CPU, and the cache keeps one entry per device. The GPU
check (benchmarks/gpu_check) runs the reference on the engine's device; on a GPU machine the last
test compares the two devices with the check's own bounds."""

import pytest
import torch

from tests.dist.reference import TrainSettings, cached_reference, flat_cat, global_batches, reference_train


@pytest.mark.parametrize("mode", ["fp32", "fp16", "autocast_bf16"])
def test_cpu_device_is_the_default_bitwise(mode):
    batches = global_batches(0, 2, 4)
    default = reference_train(batches, mode)
    named = reference_train(batches, mode, device="cpu")
    assert named.losses == default.losses and named.grad_norms == default.grad_norms
    for a, b in zip(named.params + named.grads, default.params + default.grads, strict=True):
        assert torch.equal(flat_cat(a), flat_cat(b))
    assert all(t.device.type == "cpu" for t in [*named.params[-1].values(), *named.grads[0].values()])


def test_the_cache_key_includes_the_device():
    cached_reference.cache_clear()
    first = cached_reference(0, 1, 4, "fp32", TrainSettings(), 1, "cpu")
    assert cached_reference(0, 1, 4, "fp32", TrainSettings(), 1, "cpu") is first
    assert cached_reference.cache_info().currsize == 1
    if torch.cuda.is_available():
        other = cached_reference(0, 1, 4, "fp32", TrainSettings(), 1, "cuda:0")
        assert other is not first and cached_reference.cache_info().currsize == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["fp32", "bf16", "autocast_bf16", "fp16"])
def test_device_reference_is_near_the_cpu_one(mode):
    from benchmarks.gpu_check.conformance import reference_device_vs_cpu

    out = reference_device_vs_cpu(mode, torch.device("cuda", 0))
    assert not isinstance(out, tuple), out
