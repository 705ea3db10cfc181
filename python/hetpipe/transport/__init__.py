"""Messages between ranks: the wire protocol, the MPI, loopback and torch p2p backends, the per-edge backend registry, the codec and device copies."""
