"""TensorSplit: a rank's piece of a whole tensor, against torch's own chunking (the independent
reference): an even split is `torch.chunk(whole, parts, dim)[index]`; with packed
sub-parameters each is chunked on its own and the rank's chunks are concatenated."""

import pytest
import torch

from zeroshard.autotp.split import TensorSplit


@pytest.mark.parametrize("dim", [0, 1])
def test_piece_is_torch_chunk_and_assemble_inverts_it(dim):
    whole = torch.randn(8, 12)
    splits = [TensorSplit(dim, 4, i, (8, 12)) for i in range(4)]
    pieces = [s.piece_of(whole) for s in splits]
    for i, piece in enumerate(pieces):
        assert torch.equal(piece, torch.chunk(whole, 4, dim)[i])
        assert piece.shape == splits[i].local_shape
    assert torch.equal(splits[0].assemble(pieces), whole)


def test_packed_sub_parameters_are_cut_one_by_one():
    whole = torch.arange(16 * 3, dtype=torch.float32).reshape(16, 3)  # q: 8 rows, k: 4, v: 4
    sizes = (8, 4, 4)
    for index in range(2):
        split = TensorSplit(0, 2, index, (16, 3), sizes)
        q, k, v = torch.split(whole, sizes, 0)
        expected = torch.cat([torch.chunk(t, 2, 0)[index] for t in (q, k, v)])
        assert torch.equal(split.piece_of(whole), expected)
    pieces = [TensorSplit(0, 2, i, (16, 3), sizes).piece_of(whole) for i in range(2)]
    assert torch.equal(TensorSplit(0, 2, 0, (16, 3), sizes).assemble(pieces), whole)


def test_uneven_splits_are_refused_and_json_round_trips():
    with pytest.raises(ValueError, match="cannot be split evenly into 4 pieces"):
        TensorSplit(0, 4, 0, (6, 2))
    with pytest.raises(ValueError, match=r"sub-parameters \[4, 2\]"):
        TensorSplit(0, 4, 0, (6, 2), (4, 2))
    split = TensorSplit(1, 2, 1, (4, 6), None)
    assert TensorSplit.from_json(split.to_json(), [4, 6], 1) == split


def test_a_modifier_ranks_counterpart_in_a_tensor_data_group():
    """GatheredParameters(modifier_rank=r) on a flat of pieces: the peers are the ranks holding the
    same pieces (world 4, tensor 2: {1, 3}); r=0 holds the other piece, its counterpart is 1."""
    from zeroshard.comm.collectives import Group
    from zeroshard.sharding.layout import ShardingSpec

    peers = Group((1, 3), 0)
    spec = ShardingSpec(peers, Group((1,), 0), peers)
    assert [spec.source_for(r) for r in range(4)] == [1, 1, 3, 3]
    world = Group((0, 1, 2, 3), 1)
    assert ShardingSpec(world, Group((1,), 0), world).source_for(2) == 2
