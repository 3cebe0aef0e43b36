"""Backward-pass mechanics usable without a pipeline: split backward, priority, parallel branches."""
