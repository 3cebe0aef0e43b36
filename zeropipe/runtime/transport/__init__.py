"""Moving tensors between ranks: the transport interface and the in-process transport, the
tagged and ordered point-to-point transports, the wire header, posting and waiting with a time
limit, step agreement, and telling peers that a rank failed."""
