"""The demo's byte-level GPT: shapes, weight tying, initial loss, generation, presets."""

import math

import pytest
import torch

from zeroshard.models import GPT, PRESETS, GPTConfig, build_gpt


@pytest.fixture
def tiny() -> GPT:
    torch.manual_seed(0)
    return build_gpt("tiny")


def test_forward_shapes(tiny: GPT) -> None:
    idx = torch.randint(0, 256, (3, 17))
    logits, loss = tiny(idx)
    assert logits.shape == (3, 17, 256)
    assert loss is None


def test_batch_tuple_gives_the_same_loss_as_two_arguments(tiny: GPT) -> None:
    x = torch.randint(0, 256, (2, 16))
    y = torch.randint(0, 256, (2, 16))
    _, loss_args = tiny(x, y)
    _, loss_tuple = tiny((x, y))
    _, loss_list = tiny([x, y])
    assert torch.equal(loss_args, loss_tuple)
    assert torch.equal(loss_args, loss_list)


def test_lm_head_is_tied_to_token_embedding(tiny: GPT) -> None:
    assert tiny.lm_head.weight is tiny.wte.weight
    names = [name for name, _ in tiny.named_parameters()]
    assert "wte.weight" in names and "lm_head.weight" not in names
    # Really shared: a change through one name shows through the other, and backward puts
    # the gradients of both uses into one .grad.
    with torch.no_grad():
        tiny.wte.weight[7, 3] = 1.25
    assert tiny.lm_head.weight[7, 3].item() == 1.25
    x = torch.randint(0, 256, (2, 8))
    tiny(x, x)[1].backward()
    assert tiny.lm_head.weight.grad is tiny.wte.weight.grad


def test_initial_loss_is_close_to_uniform_over_bytes(tiny: GPT) -> None:
    # At init the logits have std ~0.02 * sqrt(n_embd) = 0.16, so the expected cross-entropy
    # against random targets is ln(256) + ~var/2 = 5.545 + ~0.013; 0.1 also covers the
    # sampling noise of 4 * 64 random targets.
    torch.manual_seed(1)
    x = torch.randint(0, 256, (4, 64))
    y = torch.randint(0, 256, (4, 64))
    _, loss = tiny(x, y)
    assert abs(loss.item() - math.log(256)) < 0.1


def test_generate_appends_exactly_max_new_tokens() -> None:
    torch.manual_seed(0)
    model = build_gpt("tiny", block_size=8)
    prompt = torch.randint(0, 256, (2, 5))
    out = model.generate(prompt, max_new_tokens=12, temperature=0.8, top_k=10)
    # 17 > block_size 8: the context is cropped while generating, the output is not.
    assert out.shape == (2, 17)
    assert torch.equal(out[:, :5], prompt)
    assert out.dtype == torch.long and int(out.min()) >= 0 and int(out.max()) < 256


def test_generate_is_reproducible_with_a_seeded_generator(tiny: GPT) -> None:
    prompt = torch.zeros(1, 1, dtype=torch.long)
    a = tiny.generate(prompt, 20, generator=torch.Generator().manual_seed(3))
    b = tiny.generate(prompt, 20, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)


def test_init_is_deterministic_given_the_seed() -> None:
    torch.manual_seed(42)
    a = build_gpt("tiny")
    torch.manual_seed(42)
    b = build_gpt("tiny")
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name


def test_blocks_are_one_module_list_of_same_class_modules(tiny: GPT) -> None:
    # The engine's automatic unit rule picks this list; each block becomes a ZeRO unit.
    assert isinstance(tiny.blocks, torch.nn.ModuleList)
    assert len(tiny.blocks) == PRESETS["tiny"].n_layer
    assert len({type(b) for b in tiny.blocks}) == 1


@pytest.mark.parametrize(
    ("preset", "low", "high"),
    [
        ("tiny", 0.1e6, 0.4e6),
        ("small", 1e6, 2e6),
        ("medium", 8e6, 14e6),
        ("gpt2-124m", 80e6, 130e6),
        ("1b", 0.9e9, 1.2e9),
    ],
)
def test_preset_sizes(preset: str, low: float, high: float) -> None:
    # The meta device builds even the 1B preset without allocating its weights.
    with torch.device("meta"):
        model = GPT(PRESETS[preset])
    assert low <= model.num_params() <= high


def test_build_gpt_overrides_and_errors() -> None:
    model = build_gpt("tiny", n_layer=2)
    assert len(model.blocks) == 2
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        build_gpt("huge")
    with pytest.raises(ValueError, match="unknown GPTConfig field"):
        build_gpt("tiny", n_layers=2)
    with pytest.raises(ValueError, match="n_embd=10 is not divisible by n_head=4"):
        GPTConfig(n_embd=10, n_head=4)


def test_sequence_longer_than_block_size_is_refused(tiny: GPT) -> None:
    with pytest.raises(ValueError, match="exceeds block_size=64"):
        tiny(torch.zeros(1, 65, dtype=torch.long))
