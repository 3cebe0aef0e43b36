"""Passes over a schedule: lowering to SEND/RECV, gradient reductions, grouped W, memory fitting,
and ``build_schedule``, which chains them."""
