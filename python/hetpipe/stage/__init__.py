"""One pipeline stage: its instruction executor, parameter bookkeeping, PS client, data feed and pacer."""
