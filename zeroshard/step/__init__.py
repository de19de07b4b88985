"""The optimizer step: reduced gradient -> master weights -> module parameters."""
