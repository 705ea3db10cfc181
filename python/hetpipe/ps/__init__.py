"""The parameter-server shard: WSP clocks and aggregation (Python oracle and replay shard), its server, the compiled core plane, and the gate that decides pull versions and apply order."""
