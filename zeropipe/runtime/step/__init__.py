"""One step of a pipeline: the executor that walks a schedule, the handler of each action,
the stages and their per-microbatch state, the batch cut into microbatches, the loss contract,
seeding, deferred BatchNorm."""
