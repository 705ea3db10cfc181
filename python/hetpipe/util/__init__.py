"""The lowest layer: what every other package may use and that uses none of them.

``errors`` (:class:`HetpipeError`, the base of every hetpipe exception), ``numbers`` (checks of the
numbers a user passes) and ``outputs`` (output paths checked before any work, files written whole).
Torch-free, numpy-free.
"""
