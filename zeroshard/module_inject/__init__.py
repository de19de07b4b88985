"""DeepSpeed's `deepspeed.module_inject` path for AutoEP (expert parallelism swapped into a
Hugging Face MoE model from the `expert_parallel` config section) and AutoTP (tensor parallelism
from the `tensor_parallel` section, zeroshard/autotp/):

    auto_ep_presets.py   the supported families and how their settings are resolved
    auto_ep_config.py    MoELayerSpec, AutoEPConfig: DeepSpeed's descriptions of a layer
    auto_ep_layer.py     AutoEPMoELayer: router, stacked experts, shared experts
    auto_ep_dispatch.py  the dropless all-to-all with splits
    auto_ep.py           detection and replacement
    auto_ep_balance.py   auxiliary-loss-free load balancing
    auto_ep_export.py    the original Hugging Face names and layout for checkpoints and exports
    autotp_config.py     TPLayerSpec, AutoTPConfig, AutoTPPresets, PartitionType: AutoTP's rules
    layers.py            LinearLayer, LinearAllreduce: the split Linear layers
"""
