"""Sharding: the parallel layout (which ranks shard and which replicate), stage policies, units,
flat parameter storage, the one all-gather, the stage-3 schedule and the hooks it shares with the
gradient path, streams, placement (offload). The machinery's lowest folder (docs/design.md
section 8): it imports none of the folders that build on it."""
