"""AutoSP (zeroshard.sequence.auto_sp, autosp_vit, autosp_fusion) equals the single-device
computation at world sizes 2 and 4, with slices of different lengths: InternVL's vision
attention (a [CLS] token) and Qwen2-VL's (no CLS, two images in cu_seqlens, rotary embeddings
gathered with the patches); the LLaVA, InternVL and Qwen2-VL fusion adapters. Outputs, input
gradients and parameter gradients (replicated ones summed over ranks). Then the same with
lengths 7 and 13 padded to a multiple of the ranks (shard_sequence, padded_sequence): the real
positions equal the single-device result on the unpadded sequence, padded outputs are zero
(attention) or the text embedding (fusion), the loss and gradients leave the padding out, and
unshard_sequence gives the whole unpadded output back.

Tolerance (fp32): atol 1e-6, rtol 1e-5: the wrapped attention runs on the same whole sequence;
gradients of replicated inputs are sums over ranks instead of one sum.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist.scenarios.autosp import all_cases, auto_wrap, padded_cases

TIMEOUT_S = 300


def _check(pair, label: str) -> None:
    mine, ref = pair
    torch.testing.assert_close(mine, ref, atol=1e-6, rtol=1e-5, msg=lambda m: f"{label}: {m}")


@pytest.mark.parametrize("world", [2, 4])
def test_autosp_equals_single_device(dist_pool, world: int) -> None:
    pool = dist_pool(world)
    runs = [{**uneven, **padded} for uneven, padded in zip(pool.run(all_cases, timeout=TIMEOUT_S),
                                                            pool.run(padded_cases, timeout=TIMEOUT_S), strict=True)]
    for rank, cases in enumerate(runs):
        assert len(cases) == 5 + 10, sorted(cases)
        for case, result in cases.items():
            for key, value in result.items():
                if key == "params":
                    assert value, f"{case}: no parameter gradients compared"
                    for name, pair in value.items():
                        _check(pair, f"world {world} rank {rank} {case} {name}")
                else:
                    _check(value, f"world {world} rank {rank} {case} {key}")


def test_auto_wrap_finds_vision_attention_once(dist_pool) -> None:
    for out in dist_pool(2).run(auto_wrap, timeout=TIMEOUT_S):
        assert out["first"] == ["UlyssesSPViTAttention", "UlyssesSPViTAttention", "LlamaAttention"], out
        assert out["second"] == out["first"], out
        assert out["cls"] == [False, False], out  # DeepSpeed wraps InternVL without a CLS token
        assert out["inner"] == ["InternVLVisionAttention", "VisionAttention"], out
