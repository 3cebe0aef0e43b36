"""Moving tensors between ranks: the transport interface, the tagged and ordered
point-to-point transports, the wire header and step agreement, posting and waiting with a
time limit, and telling peers that a rank failed."""
