"""Checkpoints of a WSP run: the on-disk format (torch-free) and the state written and restored (torch)."""
