"""AutoEP built DeepSpeed's way, against DeepSpeed's own classes on the same weights and inputs
(CPU, fp32, one process): `AutoEPMoELayer(spec, block, 1, 0, config)` on a transformers 5
Mixtral block with route_scale 2.5, `TokenChoiceTopKRouter` (sigmoid, 4 groups of 2, 2 kept,
renormalised, scale 2.5) and `GroupedExperts` (loop path). Prints a table and writes JSON.

    python benchmarks/autoep_deepspeed_parity.py --deepspeed-python /tmp/dsvenv/bin/python --out parity.json

Each interpreter runs this file with `--side`; the first run writes the weights and inputs the
second one loads, so both compute on the same tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch


def _side(side: str, work: str) -> None:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    if side == "deepspeed":
        from deepspeed.module_inject.auto_ep_config import AutoEPConfig, MoELayerSpec
        from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer
        from deepspeed.moe.ep_experts import GroupedExperts
        from deepspeed.moe.ep_router import TokenChoiceTopKRouter
    else:
        from zeroshard.module_inject.auto_ep_config import AutoEPConfig, MoELayerSpec
        from zeroshard.module_inject.auto_ep_layer import AutoEPMoELayer
        from zeroshard.moe.ep_experts import GroupedExperts
        from zeroshard.moe.ep_router import TokenChoiceTopKRouter

    config = MixtralConfig(hidden_size=16, intermediate_size=8, num_local_experts=4, num_experts_per_tok=2)
    config._experts_implementation = "eager"
    block = MixtralSparseMoeBlock(config)
    router = TokenChoiceTopKRouter(64, 8, 4, 2, 2, "sigmoid", True, 2.5, False)
    experts = GroupedExperts(64, 32, 4, use_grouped_mm=False)
    shared = os.path.join(work, "inputs.pt")
    if not os.path.exists(shared):
        torch.manual_seed(0)
        with torch.no_grad():
            for p in [*block.parameters(), *router.parameters(), *experts.parameters()]:
                p.normal_(0, 0.5)
        torch.save({"block": block.state_dict(), "router": router.state_dict(), "experts": experts.state_dict(),
                    "x": torch.randn(2, 5, 16), "tokens": torch.randn(50, 64)}, shared)
    state = torch.load(shared)
    block.load_state_dict(state["block"])
    router.load_state_dict(state["router"])
    experts.load_state_dict(state["experts"])
    spec = MoELayerSpec(
        moe_module_name="model.layers.0.mlp", model_family="mixtral", router_name="gate", experts_name="experts",
        expert_storage="fused_3d", expert_w1_name="gate_up_proj", expert_w2_name="down_proj", expert_w3_name=None,
        num_experts=4, top_k=2, hidden_size=16, ffn_hidden_size=8, score_func="softmax", score_apply="post",
        route_norm=True, gate_bias=False, return_router_logits=False, router_logits_capture_target="none",
        router_logits_capture_index=None, router_logits_capture_layer_name=None, has_shared_experts=False,
        shared_experts_name="", route_scale=2.5,
    )
    layer = AutoEPMoELayer(spec, block, ep_size=1, ep_rank=0,
                           config=AutoEPConfig(enabled=True, autoep_size=1, use_grouped_mm=False))
    with torch.no_grad():
        out = layer(state["x"])
        weights, selected, counts = router(state["tokens"])
        expert_out = experts(state["tokens"][:8] * 0.1, torch.tensor([2, 1, 3, 2]))
    order = selected.argsort(-1)
    torch.save({"layer": out[0] if isinstance(out, tuple) else out, "selected": selected.sort(-1).values,
                "weights": weights.gather(1, order), "counts": counts, "experts": expert_out},
               os.path.join(work, f"{side}.pt"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deepspeed-python", default="/tmp/dsvenv/bin/python")
    parser.add_argument("--out", default=None)
    parser.add_argument("--side", choices=("zeroshard", "deepspeed"))
    parser.add_argument("--work", default=None)
    args = parser.parse_args()
    if args.side:
        _side(args.side, args.work)
        return
    with tempfile.TemporaryDirectory() as work:
        for side, python in (("zeroshard", sys.executable), ("deepspeed", args.deepspeed_python)):
            subprocess.run([python, __file__, "--side", side, "--work", work], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        ours, theirs = torch.load(os.path.join(work, "zeroshard.pt")), torch.load(os.path.join(work, "deepspeed.pt"))
    rows = []
    for key in ours:
        a, b = ours[key].double(), theirs[key].double()
        rows.append({"output": key, "max_abs_diff": float((a - b).abs().max()), "max_abs": float(b.abs().max()),
                     "equal": bool(torch.equal(ours[key], theirs[key]))})
    print(f"{'output':<10} {'max |zeroshard - deepspeed|':>28} {'max |deepspeed|':>16} {'bit-equal':>10}")
    for r in rows:
        print(f"{r['output']:<10} {r['max_abs_diff']:>28.3e} {r['max_abs']:>16.3e} {str(r['equal']):>10}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
