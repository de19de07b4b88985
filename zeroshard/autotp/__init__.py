"""AutoTP: tensor parallelism from the model's own plan, as DeepSpeed 0.19.8 does it
(docs/tensor-parallel.md). The `tensor_parallel` config section is zeroshard/config/tensor_parallel.py,
the groups are the layout's tensor dimension (zeroshard/sharding/layout.py), the exchanges
zeroshard/comm/tensor_parallel.py.

    specs.py        DeepSpeed's rules: TPLayerSpec, AutoTPConfig, AutoTPPresets; the HF plan read as them
    plan.py         every Linear layer's split, decided without process groups; refusals by layer name
    split.py        TensorSplit: where a rank's piece sits in the whole tensor
    layers.py       LinearLayer (column), LinearAllreduce (row): the split layers
    transform.py    apply_autotp: the plan applied over the tensor group at initialize
    input_check.py  the first batch must be the same on every rank of a tensor group
    model_init.py   deepspeed.tp_model_init (records for the next initialize)
    report.py       what `zeroshard explain` shows
"""
