"""One step of a pipeline: the executor that walks a schedule (and the in-process transport
of a pipeline whose ranks are all in one process), the handler of each action, the stages and
their per-microbatch state, the batch cut into microbatches, the loss contract, seeding,
deferred BatchNorm."""
