"""Rules of `"zeroshard": {"deterministic_reduction": true}` across sections.

The mode sums a step's W x GAS micro-batch gradients in one pairwise tree that depends on their
count only (zeroshard/grads/tree_reduce.py's note). A config is refused where that cannot hold:

* the cross-rank levels of the tree are whole subtrees only when the data-parallel size W is a
  power of two (any accumulation), or when there is no accumulation (W = N, any N);
* the leaves are whole micro-batches: sequence parallelism splits each one over ranks (its
  gradient is a sum of sequence slices, cut differently at another sequence size), and expert
  parallelism runs an expert on tokens of several micro-batches in one matmul;
* tensor parallelism (AutoTP) splits a micro-batch's matmuls over the tensor group: its gradient
  is summed by the split layers' exchanges, an order the tensor size decides (refused until that
  is made part of the tree);
* hybrid sharding reduces over replica groups after the shard groups (a second tree level
  across ranks that the all-to-all does not cover);
* the accumulation boundary is the engine's to count (managed accumulation).
"""

from __future__ import annotations

from zeroshard.config.schema import ZeroshardConfig

KEY = "zeroshard.deterministic_reduction=true"


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def deterministic_reduction_problems(cfg: ZeroshardConfig, world_size: int) -> list[str]:
    """The reasons the mode cannot hold for this config at `world_size` ranks; none when it is off."""
    if not cfg.zeroshard.deterministic_reduction:
        return []
    problems = []
    sp = cfg.sequence_parallel_size
    if sp > 1:
        problems.append(
            f"{KEY}: sequence_parallel_size={sp} splits every micro-batch over {sp} ranks, so its gradient "
            "is a sum of sequence slices that another sequence size cuts differently. Set "
            "sequence_parallel_size to 1, or turn deterministic_reduction off."
        )
    data = max(1, world_size // sp)
    steps = cfg.gradient_accumulation_steps or 1
    if steps > 1 and not is_power_of_two(data):
        problems.append(
            f"{KEY}: data-parallel size {data} with gradient_accumulation_steps={steps}: the ranks' level of "
            "the summation tree is a whole subtree only for a power-of-two number of ranks. Use 1, 2, 4, 8, ... "
            "ranks, or gradient_accumulation_steps 1 (train_batch_size = micro-batch x ranks)."
        )
    if not cfg.managed_gradient_accumulation:
        problems.append(
            f"{KEY}: managed_gradient_accumulation=false lets step() end an accumulation anywhere; the tree "
            "needs gradient_accumulation_steps micro-batches per step. Set managed_gradient_accumulation to "
            "true, or turn deterministic_reduction off."
        )
    shard = cfg.zeroshard.shard_group_size
    if shard is not None and shard < world_size:
        problems.append(
            f"{KEY}: zeroshard.shard_group_size={shard} replicates shards over {world_size // shard} groups, "
            "which would sum them in a second, separate reduction. Leave shard_group_size unset, or turn "
            "deterministic_reduction off."
        )
    tp = cfg.tensor_parallel.size
    if tp > 1:
        problems.append(
            f"{KEY}: tensor_parallel.autotp_size={tp} splits every micro-batch's matmuls over {tp} ranks, "
            "whose exchanges sum the gradient in an order the tensor size decides. Set autotp_size to 1 "
            "(or remove the tensor_parallel section), or turn deterministic_reduction off."
        )
    ep = cfg.expert_parallel
    if ep.enabled and ep.autoep_size > 1:
        problems.append(
            f"{KEY}: expert_parallel.autoep_size={ep.autoep_size}: an expert computes on the tokens of "
            f"{ep.autoep_size} ranks' micro-batches in one matmul, so its gradient depends on which micro-"
            "batches share a rank group. Set autoep_size to 1, or turn deterministic_reduction off."
        )
    return problems
