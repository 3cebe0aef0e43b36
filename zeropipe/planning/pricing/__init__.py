"""What one layer of a transformer costs on one GPU, from its shape and the accelerator's rates.

``transformer``: a decoder's shape (:class:`~zeropipe.planning.pricing.transformer.ModelSpec`,
dense or a mixture of experts) and the price of its blocks, embedding and head;
``tensor_parallel``: what tp divides and adds; ``moe``: what experts, expert parallelism
(ep) and multi-head latent attention add; ``context_parallel``: what sharding each sequence
over cp GPUs (ring attention) divides and adds; ``links``: which link a transfer takes.
No torch here.
"""
