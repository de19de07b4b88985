"""What a run shows of itself: timers, FLOPs, collective and MoE figures (docs/monitoring.md)."""
