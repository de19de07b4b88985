"""Check f (item 3 of issue 25): tokens/s and peak memory of one model trained by a plain PyTorch
loop (the ceiling), torch FSDP2 on one device, and zeroshard stages 0-3, plus a bf16 matmul's
throughput measured here as the reachable peak.

The model is the demo's `1b` preset (zeroshard/models/gpt.py: 20 layers, width 2048, 16 heads,
byte vocabulary, SDPA attention), bf16, sequence length 2048; on the CPU the `tiny` preset at
sequence 64. Every engine trains the same model from the same seed with AdamW and clipping at 1.0:

- plain: fp32 parameters, forward under torch.autocast(bf16), fused AdamW, clip_grad_norm_;
- fsdp2: fully_shard on each block and the root, MixedPrecisionPolicy(bf16 params, fp32 reduce);
- zeroshard sN: the DeepSpeed-format config with bf16 enabled (bf16 parameters, fp32 masters);
- check h, each "-compiled" (issue 40): the same, every block compiled (inductor on a GPU,
  aot_eager on the CPU): zeroshard by `engine.compile()`, the plain loop and FSDP2 by torchtitan's
  recipe (each block replaced by `torch.compile(block, fullgraph=True)`, FSDP2's `fully_shard`
  after it). `first_step_s` is the first step, compiling included (for every row: the eager rows'
  is their warm-up cost).

MFU counts 6 N + 12 L h s FLOPs per token (PaLM's formula: N the parameters that multiply, i.e.
without the position embedding; the attention term counts the full, not the causal, square). N is
counted on the model as built, before any engine wraps it: stage 3 (and FSDP2) leave parameters
freed or partitioned, and the first run's stage-3 row counted 7x too few FLOPs that way.

Memory, per row (GiB, `torch.cuda.memory_allocated`): `built_gb` once the engine is built (model
states before the optimizer creates its state), `states_gb` after the first optimizer step (every
model state: parameters, masters, optimizer state, gradient buffers kept across steps),
`peak_fwd_bwd_gb` the peak during forward and backward, `peak_update_gb` during the optimizer step
(clipping, the step, publishing), both over the timed steps; `peak_alloc_gb` is the larger.
docs/benchmarks.md accounts for zeroshard's bytes against FSDP2's.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from zeroshard.models import GPT, build_gpt

H100_BF16_DENSE_TFLOPS = 989.0
ADAMW = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
ENGINES = ("plain", "zeroshard-s3", "fsdp2", "zeroshard-s0", "zeroshard-s1", "zeroshard-s2")
# Each compiled block by block (issue 40): the plain loop and FSDP2 as torchtitan does (every block
# under torch.compile(fullgraph=True), FSDP2's fully_shard after, on the compiled blocks), zeroshard
# with engine.compile(). The CPU run checks one of each (COMPILED_ON_CPU).
COMPILED = ("plain-compiled", "zeroshard-s3-compiled", "fsdp2-compiled", "zeroshard-s0-compiled",
            "zeroshard-s1-compiled", "zeroshard-s2-compiled")
COMPILED_ON_CPU = ("plain-compiled", "zeroshard-s3-compiled", "fsdp2-compiled")


def compile_backend(device: torch.device) -> str:
    """inductor on a GPU; aot_eager on the CPU (the CPU run checks the code, and a cold inductor
    compile there costs minutes)."""
    return "inductor" if device.type == "cuda" else "aot_eager"


@dataclass(frozen=True)
class BenchSize:
    preset: str
    seq: int
    micro: int
    warmup: int
    steps: int

    @staticmethod
    def for_device(device: torch.device, quick: bool) -> BenchSize:
        if device.type != "cuda":
            return BenchSize("tiny", 64, 2, 1, 3)
        warmup, steps = (1, 3) if quick else (3, 10)
        return BenchSize("1b", 2048, micro_batch_from_memory(), warmup, steps)


def micro_batch_from_memory(seq: int = 2048, layers: int = 20, width: int = 2048, params: float = 1.01e9) -> int:
    """The micro-batch picked from memory arithmetic (no search: a search costs device minutes).

    Model states: at most 18 bytes per parameter (zeroshard stage 0 bf16: 2 bf16 parameter, 4
    fp32 master, 4 fp32 gradient, 8 AdamW), 18 GB here. Activations kept for backward, bf16,
    with flash attention: about 34 h bytes per token and layer (Korthikanti et al.'s count
    without the attention-score term), 2.85 GB per 2048-token sequence over 20 layers. 75% of
    the device's memory is the budget (the rest: the allocator's fragmentation, logits,
    dropout masks, workspaces). On an H100 (79.6 GiB = 85.5e9 bytes): (64.1e9 - 18.2e9) /
    2.85e9 = 16.1, and 16 is the cap.
    """
    total = torch.cuda.get_device_properties(0).total_memory
    per_sequence = 34 * width * seq * layers
    return max(1, min(16, int((0.75 * total - 18 * params) // per_sequence)))


def flops_per_token(model: GPT, seq: int) -> float:
    cfg = model.config
    multiplying = model.num_params() - model.wpe.weight.numel()
    return 6 * multiplying + 12 * cfg.n_layer * cfg.n_embd * seq


def matmul_tflops(device: torch.device) -> dict[str, Any]:
    """A bf16 square matmul's throughput (TFLOP/s): the peak this device reaches in practice."""
    n = 8192 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    reps = 30 if device.type == "cuda" else 5
    for _ in range(3):
        a @ b
    _sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(device)
    seconds = (time.perf_counter() - start) / reps
    return {"n": n, "tflops": 2 * n**3 / seconds / 1e12}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _fresh(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _build(size: BenchSize, device: torch.device) -> GPT:
    torch.manual_seed(0)
    with torch.device(device):
        return build_gpt(size.preset, block_size=max(size.seq, 64))


def _compile_blocks(model: GPT, backend: str) -> None:
    """torchtitan's per-block compile: each block replaced by its torch.compile wrapper."""
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, backend=backend, fullgraph=True)


class _Plain:
    """Each runner: `backward(x, y)` (forward and backward; the loss) then `update()` (clipping,
    the optimizer step); `flops_token` counted on the model before wrapping."""

    def __init__(self, size: BenchSize, device: torch.device, compiled: bool = False) -> None:
        self.device = device
        self.model = _build(size, device)
        self.flops_token = flops_per_token(self.model, size.seq)
        if compiled:
            _compile_blocks(self.model, compile_backend(device))
        fused = {"fused": True} if device.type == "cuda" else {}
        self.opt = torch.optim.AdamW(self.model.parameters(), **ADAMW, **fused)

    def backward(self, x, y) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            _, loss = self.model(x, y)
        loss.backward()
        return loss.detach()

    def update(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class _FSDP2(_Plain):
    def __init__(self, size: BenchSize, device: torch.device, compiled: bool = False) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        self.device = device
        self.model = _build(size, device)
        self.flops_token = flops_per_token(self.model, size.seq)
        if compiled:  # before fully_shard, so that its hooks sit on the wrappers, outside the graphs
            _compile_blocks(self.model, compile_backend(device))
        mesh = init_device_mesh(device.type, (1,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(self.model, mesh=mesh, mp_policy=policy)
        # DTensor parameters: torch's default (foreach) AdamW, as benchmarks/peers_engines.py.
        self.opt = torch.optim.AdamW(self.model.parameters(), **ADAMW)

    def backward(self, x, y) -> torch.Tensor:
        _, loss = self.model(x, y)
        loss.backward()
        return loss.detach()


class _Zeroshard:
    def __init__(self, size: BenchSize, device: torch.device, stage: int, compiled: bool = False) -> None:
        import zeroshard

        self.device = device
        model = _build(size, device)
        self.flops_token = flops_per_token(model, size.seq)  # before stage 3 partitions it
        config = {
            "train_micro_batch_size_per_gpu": size.micro,
            "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {**ADAMW, "betas": list(ADAMW["betas"])}},
            "gradient_clipping": 1.0,
            "zero_optimization": {"stage": stage},
            "bf16": {"enabled": True},
            "steps_per_print": 1_000_000,
        }
        self.engine, _, _, _ = zeroshard.initialize(model=model, config=config)
        if compiled:
            self.engine.compile(backend=compile_backend(device))

    def backward(self, x, y) -> torch.Tensor:
        _, loss = self.engine(x, y)
        self.engine.backward(loss)
        return loss.detach()

    def update(self) -> None:
        self.engine.step()

    def close(self) -> None:
        self.engine.destroy()


def _make(engine: str, size: BenchSize, device: torch.device):
    compiled = engine.endswith("-compiled")
    engine = engine.removesuffix("-compiled")
    if engine == "plain":
        return _Plain(size, device, compiled)
    if engine == "fsdp2":
        return _FSDP2(size, device, compiled)
    return _Zeroshard(size, device, int(engine.rsplit("s", 1)[1]), compiled)


class _Memory:
    """Allocated bytes at the points the module docstring names (CUDA only; nothing elsewhere)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.numbers: dict[str, float] = {}

    def now(self, key: str) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.numbers[key] = torch.cuda.memory_allocated() / 2**30

    @contextlib.contextmanager
    def peak(self, key: str):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        yield
        if self.cuda:
            torch.cuda.synchronize()
            self.numbers[key] = torch.cuda.max_memory_allocated() / 2**30


def _measure(engine: str, size: BenchSize, device: torch.device) -> dict[str, Any]:
    memory = _Memory(device)
    runner = _make(engine, size, device)
    try:
        memory.now("built_gb")
        gen = torch.Generator().manual_seed(1)
        x = torch.randint(0, 256, (size.micro, size.seq), generator=gen).to(device)
        y = torch.randint(0, 256, (size.micro, size.seq), generator=gen).to(device)
        losses = []
        for i in range(size.warmup):
            start = time.perf_counter()
            losses.append(float(runner.backward(x, y)))
            runner.update()
            if i == 0:
                _sync(device)
                first_step_s = time.perf_counter() - start  # a compiled runner's compile time is in it
                memory.now("states_gb")
        # One untimed step split in its two phases (each phase's peak needs a synchronisation
        # on both sides, which the timed steps should not pay).
        with memory.peak("peak_fwd_bwd_gb"):
            losses.append(float(runner.backward(x, y)))
        with memory.peak("peak_update_gb"):
            runner.update()
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(size.steps):
            start = time.perf_counter()
            loss = runner.backward(x, y)
            runner.update()
            _sync(device)
            times.append(time.perf_counter() - start)
            losses.append(float(loss))
        out = {"micro": size.micro, "step_s": statistics.median(times), "first_step_s": first_step_s,
               "flops_token": runner.flops_token, "loss_first": losses[0], "loss_last": losses[-1]}
        if device.type == "cuda":
            out["peak_alloc_gb"] = torch.cuda.max_memory_allocated() / 2**30
            out["peak_reserved_gb"] = torch.cuda.max_memory_reserved() / 2**30
        return {**out, **memory.numbers}
    finally:
        if hasattr(runner, "close"):
            runner.close()


def bench_engine(engine: str, size: BenchSize, device: torch.device, matmul: float | None) -> dict[str, Any]:
    """One engine's row: tokens/s, step time, peak memory, MFU against the bf16 dense peak and
    against the matmul measured here. On out-of-memory, once more at two thirds the micro-batch."""
    _fresh(device)
    micro = size.micro
    out = None
    for attempt in range(2):
        oom = False
        try:
            out = _measure(engine, BenchSize(size.preset, size.seq, micro, size.warmup, size.steps), device)
        except torch.OutOfMemoryError:
            if attempt == 1 or micro == 1:
                raise
            oom = True
        _fresh(device)
        if not oom:
            break
        micro = max(1, micro * 2 // 3)
    assert out is not None
    tokens_s = out["micro"] * size.seq / out["step_s"]
    achieved = tokens_s * out["flops_token"] / 1e12
    out["tokens_s"] = tokens_s
    out["tflops"] = achieved
    if device.type == "cuda":
        out["mfu_989"] = achieved / H100_BF16_DENSE_TFLOPS
    if matmul:
        out["mfu_matmul"] = achieved / matmul
    return out
