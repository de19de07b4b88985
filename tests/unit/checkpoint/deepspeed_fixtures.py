"""Paths and expectations of the DeepSpeed 0.19.8 fixtures (tests/fixtures/deepspeed/regenerate.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "deepspeed"
CASES = ["s0_fp32_w1", "s0_bf16_w2", "s1_fp32_w2_adam", "s1_bf16_w1", "s2_fp32_w1", "s2_bf16_w2", "s2_fp16_w2",
         "s3_fp32_w2", "s3_bf16_w1"]
UNIVERSAL = FIXTURES / "universal"
UNIVERSAL_FROM = "s2_bf16_w2"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def fixture_model():
    """tests/fixtures/deepspeed/model.py: the model, data and config both engines ran."""
    if "ds_fixture_model" not in sys.modules:
        spec = importlib.util.spec_from_file_location("ds_fixture_model", FIXTURES / "model.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["ds_fixture_model"] = module
        spec.loader.exec_module(module)
    return sys.modules["ds_fixture_model"]


def parse_case(case: str) -> tuple[int, str, int, str]:
    parts = case.split("_")
    return int(parts[0][1:]), parts[1], int(parts[2][1:]), "Adam" if case.endswith("_adam") else "AdamW"


def ckpt(case: str) -> Path:
    return FIXTURES / case / "ckpt"


def expected(case: str) -> dict:
    """What DeepSpeed read from its own run: at the save (`at_save`) and K+M steps in (`after`)."""
    return torch.load(FIXTURES / case / "expected_ds.pt", weights_only=True)


def zero_to_fp32(case: str) -> dict[str, torch.Tensor]:
    return torch.load(FIXTURES / case / "zero_to_fp32.pt", weights_only=True)
