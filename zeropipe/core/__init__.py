"""The schedule layer, without torch: the IR, the one dependency model, validation,
lowering, W grouping, reductions, costs, simulation, rendering, the schedule builder,
message order and the generators (``schedules/``, the ``auto`` search included).

Everything above it may import from here; nothing here imports torch or any other
zeropipe layer.  docs/architecture.md lists what each module holds.
"""
