"""TRL's `SFTTrainer` on zeroshard through the `deepspeed` alias (tests/dist/hf/test_trl_sft.py).

Everything is local: a word-level tokenizer built with `tokenizers` and wrapped in
`PreTrainedTokenizerFast`, a tiny Llama from a config, and an in-memory `datasets.Dataset` of
short sentences. Each run is `SFTTrainer(model, args=SFTConfig(...), train_dataset,
processing_class=tokenizer).train()`: without DeepSpeed (DDP, the reference) and with a
DeepSpeed config (ZeRO-3), the per-step losses the Trainer logs compared.

After the ZeRO-3 run, TRL's `unwrap_model_for_generation(engine, accelerator)` (the helper GRPO,
online DPO and the completion callbacks generate with) greedily generates from every parameter
gathered, with stage 3's hooks removed: each rank a different number of tokens, which would
hang if a forward still gathered (a collective). Its tokens must equal the same generation by a
plain model holding the gathered weights; afterwards the hooks are back and a forward through
the engine gives the plain model's loss.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from tests.dist.scenarios.hf_common import reset_trainer_state, use_alias

WORDS = ("the a cat dog bird fish sees likes runs sleeps eats jumps over under near big small red blue green "
         "quick slow happy sad tree house river hill and with on in").split()
SPECIAL = ["[PAD]", "[UNK]", "[BOS]", "[EOS]"]
STEPS = 4


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", bos_token="[BOS]",
                                   eos_token="[EOS]")


def sentences(n: int = 32) -> list[str]:
    gen = torch.Generator().manual_seed(7)
    return [" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (int(length),), generator=gen))
            for length in torch.randint(5, 12, (n,), generator=gen)]


def tiny_model(tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    return LlamaForCausalLM(config)


def ds_config(stage: int) -> dict[str, Any]:
    """As a TRL user writes it: "auto" wherever the Trainer fills the value in."""
    return {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
        "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW",
                      "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
        # 0: every unit of the tiny model is partitioned (the default keeps units under 1e5 elements whole).
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }


_TASK_ENV: dict[str, str] = {}


def _reset() -> None:
    reset_trainer_state(_TASK_ENV)


def sft(workdir: str, name: str, deepspeed: dict | None):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    _reset()
    tok = tokenizer()
    args = SFTConfig(
        output_dir=os.path.join(workdir, name), per_device_train_batch_size=2, gradient_accumulation_steps=2,
        max_steps=STEPS, learning_rate=1e-3, logging_steps=1, use_cpu=True, deepspeed=deepspeed, report_to=[],
        seed=0, save_strategy="no", max_length=16, dataloader_drop_last=True, bf16=False,
    )
    trainer = SFTTrainer(model=tiny_model(tok), args=args, train_dataset=Dataset.from_dict({"text": sentences()}),
                         processing_class=tok)
    trainer.train()
    losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    losses["wrapper"] = type(trainer.model_wrapped).__name__
    return trainer, losses


def _generation(trainer) -> dict[str, Any]:
    """TRL's ZeRO-3 generation helper against a plain model holding the gathered weights."""
    import deepspeed
    from trl.models.utils import unwrap_model_for_generation

    engine, tok = trainer.model_wrapped, trainer.processing_class
    rank = dist.get_rank()
    prompt = tok(["the cat sees", "a big dog"][rank], return_tensors="pt").input_ids
    new_tokens = 3 + 4 * rank  # different on each rank: no collective may run during generation
    inner = engine._grads
    with unwrap_model_for_generation(engine, trainer.accelerator) as unwrapped:
        hooks_removed = inner.params is None
        generated = unwrapped.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                       do_sample=False, pad_token_id=tok.pad_token_id)
    hooks_back = inner.params is not None
    freed_again = all(p.numel() == 0 for p in engine.module.model.layers[0].parameters())
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    plain = tiny_model(tok)
    plain.load_state_dict(weights, strict=False)  # tied/buffers as built
    plain.eval()
    expected = plain.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=tok.pad_token_id)
    # The schedule is back: a forward through the engine (gathers and frees) gives the plain loss.
    batch = tok(["the dog runs near the river"], return_tensors="pt").input_ids
    engine.eval()
    with torch.no_grad():
        engine_loss = engine(input_ids=batch, labels=batch).loss.item()
        plain_loss = plain(input_ids=batch, labels=batch).loss.item()
    return {"generated": generated, "expected": expected, "hooks_removed": hooks_removed, "hooks_back": hooks_back,
            "freed_again": freed_again, "engine_loss": engine_loss, "plain_loss": plain_loss,
            "has_offload": hasattr(engine.optimizer, "parameter_offload")}


def sft_runs(alias_dir: str, workdir: str) -> dict[str, Any]:
    use_alias(alias_dir)
    _TASK_ENV.clear()
    _TASK_ENV.update(os.environ)
    out: dict[str, Any] = {"losses": {}}
    out["losses"]["ddp"] = sft(workdir, "ddp", None)[1]
    trainer, out["losses"]["stage3"] = sft(workdir, "stage3", ds_config(3))
    out["generation"] = _generation(trainer)
    _reset()
    return out
