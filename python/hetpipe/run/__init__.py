"""Assembling and driving a run: its spec, building each rank's part, the Trainer (the user API), records and the single-process replay."""
