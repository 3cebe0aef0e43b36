"""``zeropipe train``: the training loop, its config and flags, what it trains, what it reports
and logs, its checkpoints and resume, and the lock a run holds on its folder."""
