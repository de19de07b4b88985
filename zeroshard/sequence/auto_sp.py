"""AutoSP: wrap the vision-encoder attention of multimodal models for sequence parallelism.

`auto_wrap_model_for_sp(model, process_group)` finds vision-encoder attention modules by class
(InternVL's `InternVisionAttention` (remote code) and `InternVLVisionAttention`
(transformers), Qwen2-VL's and Qwen2.5-VL's vision `VisionAttention` /
`Qwen2_5_VLVisionAttention`), all with `has_cls_token=False` as DeepSpeed wraps InternVL's: a
[CLS] token, where the encoder has one, is then the first position of rank 0's slice, not
replicated (the gathered attention computes the same either way); it replaces each with
`UlyssesSPViTAttention`. Decoder attention is left alone: Hugging Face decoders get Ulysses
through `UlyssesSPAttentionHF.register_with_transformers` (ALST), so nothing is wrapped twice;
wrapping an already wrapped model changes nothing.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from zeroshard.sequence.autosp_vit import UlyssesSPViTAttention

__all__ = ["auto_wrap_model_for_sp", "VISION_ATTENTION_CLASSES"]

# class name -> wrapped with has_cls_token (DeepSpeed's `_VIT_HAS_CLS_TOKEN` values). Qwen2-VL's
# `VisionAttention` is matched with its module, as the name alone is generic.
VISION_ATTENTION_CLASSES: dict[str, bool] = {
    "InternVisionAttention": False,
    "InternVLVisionAttention": False,
    "Qwen2_5_VLVisionAttention": False,
    "transformers.models.qwen2_vl.modeling_qwen2_vl.VisionAttention": False,
}


def _has_cls_token(module: nn.Module) -> bool | None:
    cls = type(module)
    for key in (f"{cls.__module__}.{cls.__qualname__}", cls.__name__):
        if key in VISION_ATTENTION_CLASSES:
            return VISION_ATTENTION_CLASSES[key]
    return None


def auto_wrap_model_for_sp(model: nn.Module, process_group: Any) -> nn.Module:
    """Replace every vision-encoder attention in `model` with `UlyssesSPViTAttention` (in place);
    returns `model`."""
    targets = []
    for parent in model.modules():
        if isinstance(parent, UlyssesSPViTAttention):
            continue
        for name, child in parent.named_children():
            has_cls = _has_cls_token(child)
            if has_cls is not None:
                targets.append((parent, name, child, has_cls))
    for parent, name, child, has_cls in targets:
        setattr(parent, name, UlyssesSPViTAttention(child, process_group, has_cls_token=has_cls))
    return model
