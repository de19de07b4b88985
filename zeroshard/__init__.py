"""zeroshard: ZeRO sharded data-parallel training for PyTorch with a precision policy you can read."""

__version__ = "0.1.0"
