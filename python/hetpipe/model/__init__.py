"""Models as ordered layer lists: the layer contract, pytrees at boundaries, shapes, the per-layer parameter layout (torch, no communication)."""
