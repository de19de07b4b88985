"""DeepSpeed 0.19's checkpoints, read and written without DeepSpeed (issue 29).

- unpickle.py: the allow-list unpickler for DeepSpeed's `.pt` files (stand-ins for its classes).
- read_ds.py / universal.py: a ZeRO 0-3 or universal checkpoint -> `PortableState` (portable.py).
- zs_format.py: `PortableState` <-> zeroshard's own format.
- write_ds.py / ds_pickle.py: `PortableState` -> the files DeepSpeed writes and loads.
- convert.py: `from_deepspeed`, `to_deepspeed`, and the hook `load_checkpoint` uses;
  commands.py: `zeroshard from-deepspeed` / `to-deepspeed`.
"""
