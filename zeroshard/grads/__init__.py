"""Gradients: from a parameter's post-accumulate hook to its reduced shard (buckets, reduction, views)."""
