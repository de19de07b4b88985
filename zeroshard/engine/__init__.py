"""The engine: composes sharding, gradients, step and optimizer into DeepSpeed's training-loop API."""
