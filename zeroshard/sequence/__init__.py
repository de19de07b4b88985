"""Sequence parallelism (docs/design.md section 9): Ulysses attention (`layer`), and its Hugging Face
integration in `zeroshard.runtime.sequence_parallel` (DeepSpeed's import paths)."""
