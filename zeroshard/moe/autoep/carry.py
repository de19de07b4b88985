"""What a swapped parameter keeps of the parameters it was built from.

AutoEP copies each MoE block's weights into new parameters (a router copy, expert stacks);
a user or a library may have marked the old ones (`requires_grad=False` to freeze the experts,
`use_muon`, `is_expert_group`, `ds_*` settings, names). Those marks are the user's intent and
must hold on the new parameters, or a fine-tune trains weights the user froze. A stack is built
from several source parameters (one per expert, or one fused tensor for two stacks): they must
agree on every mark, since one parameter can carry only one value.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["carried_marks", "apply_marks"]

# zero.Init's record of how the *old* tensor is partitioned (zeroshard/zero/partition.py): it
# describes that tensor's storage, not the user's intent, and would be false on the new one.
_STORAGE_MARKS = frozenset({"ds_shape", "ds_numel", "ds_tensor", "_zeroshard_init_partition"})
_ABSENT = object()


def _marks(p: nn.Parameter) -> dict[str, Any]:
    marks = {k: v for k, v in vars(p).items() if k not in _STORAGE_MARKS}
    marks["requires_grad"] = p.requires_grad
    return marks


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # e.g. tensors of several elements: only the same object counts as equal
        return False


def carried_marks(target: str, sources: list[tuple[str, nn.Parameter]]) -> dict[str, Any]:
    """The marks (attributes and `requires_grad`) the parameter `target` takes from `sources`
    (name, parameter) it is built from. A private attribute (leading underscore) the sources
    disagree on is left off.

    Raises:
        ValueError: the sources disagree on `requires_grad` or a public attribute; the message
            names the mark, the target and the sources with each value.
    """
    per_source = [(name, _marks(p)) for name, p in sources]
    keys = sorted({k for _, marks in per_source for k in marks})
    merged: dict[str, Any] = {}
    for key in keys:
        values = [(name, marks.get(key, _ABSENT)) for name, marks in per_source]
        first = values[0][1]
        if any(not _same(first, v) for _, v in values[1:]):
            if key.startswith("_"):
                # A library's private bookkeeping of the old tensors (transformers marks the
                # weights it loaded `_is_hf_initialized`): no user intent to keep, none to refuse.
                continue
            shown = ", ".join(f"{name}={'(unset)' if v is _ABSENT else repr(v)}" for name, v in values)
            raise ValueError(
                f"AutoEP stacks {len(sources)} expert weights into {target}, which can hold one value of "
                f"{key!r}, but they differ: {shown}. Give every expert of the block the same {key!r} "
                "(e.g. freeze all experts or none) before initialize, or leave expert_parallel off."
            )
        merged[key] = first
    return merged


def apply_marks(p: nn.Parameter, marks: dict[str, Any]) -> None:
    """Set `marks` (from `carried_marks`) on the new parameter `p`."""
    for key, value in marks.items():
        if key == "requires_grad":
            p.requires_grad_(value)
        else:
            setattr(p, key, value)
