"""Hugging Face front end: ``from hetpipe.hf import Trainer`` in a script written for
``transformers.Trainer`` (:mod:`hetpipe.hf.trainer`)."""

from hetpipe.hf.trainer import KEEP_ALL, Trainer

__all__ = ["Trainer", "KEEP_ALL"]
