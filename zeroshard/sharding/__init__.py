"""Sharding: the parallel layout (which ranks shard and which replicate), stage policies, units,
flat parameter storage, the one all-gather, the stage-3 schedule, streams, placement (offload),
and the full-tensor views of sharded state."""
