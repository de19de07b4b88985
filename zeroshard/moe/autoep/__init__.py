"""AutoEP: expert parallelism swapped into a Hugging Face MoE model from the `expert_parallel`
config section.

    presets.py   the supported families and how their settings are resolved
    layer.py     AutoEPMoELayer: router, stacked experts, shared experts
    dispatch.py  the dropless all-to-all with splits
    swap.py      detection and replacement
    balance.py   auxiliary-loss-free load balancing
    export.py    the original Hugging Face names and layout for checkpoints and exports
"""
