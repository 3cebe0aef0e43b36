"""Memory a step holds: saved-activation accounting, recompute, activation and weight offload."""
