"""What an MoE user watches, per MoE layer: expert load, dropped routes, the auxiliary loss
and the aux-loss-free balancing bias. On whenever the model has MoE layers.

Per layer, over the steps of an interval (`steps_per_print`), per optimizer step:

    tokens per expert   routes each expert was chosen for, before capacity drops (they sum
                        to tokens x k); min, max and coefficient of variation (std / mean)
    dropped             routes that found no slot (capacity drops; 0 for dropless layers)
    aux_loss            the router's auxiliary loss, mean over the interval's forwards
                        (DeepSpeed's MoE layers; AutoEP leaves it to the model)
    bias_norm           L2 norm of an AutoEP router's `e_score_correction_bias`
    all_to_all_ms       the token exchange's all-to-all time per step, every layer together
                        (from issue to completion; 0 without expert parallelism)

The counts are this rank's own tokens (no collective is added to read them), accumulated on
the device in training forwards and read at the interval's end: one host read per interval.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["MoEFigures"]


class _LayerTally:
    def __init__(self, num_experts: int, bias: torch.Tensor | None) -> None:
        self.num_experts = num_experts
        self.bias = bias
        self.counts: torch.Tensor | None = None
        self.dropped: torch.Tensor | None = None
        self.aux_sum: torch.Tensor | None = None
        self.forwards = 0

    def add(self, counts: torch.Tensor, kept: torch.Tensor | None, aux: torch.Tensor | None) -> None:
        counts = counts.detach().to(torch.int64)
        self.counts = counts if self.counts is None else self.counts + counts
        dropped = counts.sum() - kept if kept is not None else counts.new_zeros(())
        self.dropped = dropped if self.dropped is None else self.dropped + dropped
        if aux is not None:
            aux = aux.detach().float()
            self.aux_sum = aux if self.aux_sum is None else self.aux_sum + aux
        self.forwards += 1


def _routers(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(layer name, the module to hook, its kind) for every MoE layer."""
    found = []
    for name, module in model.named_modules():
        if getattr(module, "_is_autoep_layer", False):
            found.append((name, module.router, "autoep"))
        elif hasattr(module, "deepspeed_moe") and hasattr(module.deepspeed_moe, "gate"):
            found.append((name, module.deepspeed_moe.gate, "deepspeed"))
    return found


class MoEFigures:
    """Hooks every MoE layer's router of `model` (none: `enabled` is False)."""

    def __init__(self, model: nn.Module) -> None:
        self._tallies: dict[str, _LayerTally] = {}
        self._handles = []
        self._steps = 0
        self._last: dict[str, dict[str, object]] = {}
        self.all_to_all_ms = 0.0
        for name, router, kind in _routers(model):
            bias = getattr(router, "e_score_correction_bias", None) if kind == "autoep" else None
            tally = _LayerTally(router.num_experts if kind == "autoep" else router.wg.out_features, bias)
            self._tallies[name] = tally
            hook = self._autoep_hook if kind == "autoep" else self._deepspeed_hook
            self._handles.append(router.register_forward_hook(hook(tally)))
        self.enabled = bool(self._tallies)
        # Only then do the layers exchange tokens (an all-to-all to time).
        self.expert_parallel = any(
            getattr(m, "ep_size", 1) > 1 for m in model.modules() if getattr(m, "_is_autoep_layer", False)
            or hasattr(m, "deepspeed_moe")
        )

    @staticmethod
    def _autoep_hook(tally: _LayerTally):
        def hook(module, args, output) -> None:
            if module.training and torch.is_grad_enabled():  # training forwards only (see below)
                _, _, selected = output  # [tokens, k]: dropless, every route is kept
                tally.add(torch.bincount(selected.reshape(-1), minlength=tally.num_experts), None, None)
        return hook

    @staticmethod
    def _deepspeed_hook(tally: _LayerTally):
        def hook(module, args, output) -> None:
            # Training forwards only (train mode, grad enabled): an evaluation under no_grad in
            # train mode would mix its routing into the training figures.
            if not (module.training and torch.is_grad_enabled()):
                return
            if len(output) == 7:  # sparse routes: indices [k, S] with -1 for a dropped route
                aux, _, _, indices, _, _, counts = output
                kept = (indices >= 0).sum()
            else:  # dense: the dispatch mask [S, E, C] marks the kept routes
                aux, _, mask, counts = output
                kept = mask.sum()
            tally.add(counts, kept, aux)
        return hook

    def step_done(self) -> None:
        self._steps += 1

    def close_interval(self, exchange_ms: float = 0.0) -> dict[str, dict[str, object]]:
        """Per layer: tokens_per_expert (mean per step), min, max, cv, dropped (per step),
        aux_loss, bias_norm; and the all-to-all time of every layer together (`exchange_ms`
        over the interval, given per step). Starts the next interval."""
        steps = max(self._steps, 1)
        self.all_to_all_ms = exchange_ms / steps
        out: dict[str, dict[str, object]] = {}
        for name, tally in self._tallies.items():
            if tally.counts is None:
                continue
            load = (tally.counts.double() / steps).cpu()
            mean = float(load.mean())
            row: dict[str, object] = {
                "tokens_per_expert": load.tolist(),
                "min": float(load.min()),
                "max": float(load.max()),
                "cv": float(load.std(unbiased=False)) / mean if mean > 0 else 0.0,
                "dropped": float(tally.dropped) / steps,
            }
            if tally.aux_sum is not None:
                row["aux_loss"] = float(tally.aux_sum) / tally.forwards
            if tally.bias is not None:
                row["bias_norm"] = float(tally.bias.float().norm())
            out[name] = row
            tally.counts = tally.dropped = tally.aux_sum = None
            tally.forwards = 0
        self._steps = 0
        self._last = out
        return out

    def summary(self) -> dict[str, float]:
        """The last interval as `moe/<layer>/<figure>` (the load as `expert<j>_tokens`)."""
        flat: dict[str, float] = {"moe/all_to_all_ms": self.all_to_all_ms} if self._last else {}
        for name, row in self._last.items():
            for key, value in row.items():
                if key == "tokens_per_expert":
                    flat.update({f"moe/{name}/expert{j}_tokens": v for j, v in enumerate(value)})
                else:
                    flat[f"moe/{name}/{key}"] = value
        return flat

    def log_lines(self) -> list[str]:
        lines = []
        for name, row in self._last.items():
            extra = "".join(f" {k} {row[k]:.4g}" for k in ("aux_loss", "bias_norm") if k in row)
            lines.append(
                f"moe {name}: tokens/expert min {row['min']:.1f} max {row['max']:.1f} cv {row['cv']:.3f} "
                f"dropped {row['dropped']:.1f}{extra}"
            )
        return lines

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


