"""Runtime: stage executor, transport, parameter-server shards, trainer and single-process replay (torch)."""
