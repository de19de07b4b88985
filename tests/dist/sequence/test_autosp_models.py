"""AutoSP on whole multimodal models from transformers 5.23, built from tiny configs (issue 42
item 3): Qwen2-VL, Qwen2.5-VL and InternVL, 2 ranks, uneven shards of the image patches.

- The class list (zeroshard/sequence/auto_sp.py) against the models' own classes: every vision
  attention is wrapped (Qwen2-VL's `VisionAttention`, `Qwen2_5_VLVisionAttention`,
  `InternVLVisionAttention`), no decoder attention is. (DeepSpeed 0.19.8's list names
  `Qwen2VLVisionAttention`, which transformers 5.23 does not have.)
- The full pipeline, visual shards to fused text embeddings (the recipes in
  docs/sequence-parallel.md), equals the unsharded model's own image features put at its
  placeholders: this rank's slice of the fused sequence, and the vision tower's (and InternVL's
  projector's) parameter gradients summed over the ranks.

Tolerance, fp32: the fused slice within 1e-6 (the wrapped attention runs on the same whole patch
sequence; only the kernels' batching differs), gradients atol 2e-6, rtol 1e-5 (each is a sum over
the ranks' slices instead of one sum; measured at most 7.2e-7).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

VISION_ATTENTION = {"qwen2_vl": "VisionAttention", "qwen2_5_vl": "Qwen2_5_VLVisionAttention",
                    "internvl": "InternVLVisionAttention"}


def test_autosp_pipelines_equal_the_unsharded_models(dist_pool) -> None:
    for rank, runs in enumerate(dist_pool(2).run("tests.dist.scenarios.autosp_models:all_models", timeout=600)):
        for kind, out in runs.items():
            label = f"rank {rank} {kind}"
            assert out["attention"]["wrapped"] == [VISION_ATTENTION[kind]] * 2, (label, out["attention"])
            assert VISION_ATTENTION[kind] not in out["attention"]["plain"], (label, out["attention"])
            assert out["attention"]["plain"], f"{label}: the decoder's attention should stay unwrapped"
            torch.testing.assert_close(out["fused"], out["ref_fused"], atol=1e-6, rtol=1e-6,
                                       msg=lambda m, s=label: f"{s}: fused embeddings: {m}")
            assert out["ref_grads"] and set(out["grads"]) == set(out["ref_grads"]), label
            for name, ref in out["ref_grads"].items():
                torch.testing.assert_close(out["grads"][name], ref, atol=2e-6, rtol=1e-5,
                                           msg=lambda m, s=label, n=name: f"{s}: {n}: {m}")
