"""The base class of every exception hetpipe raises."""


class HetpipeError(Exception):
    """The base of every hetpipe exception: ``except hetpipe.HetpipeError`` catches each of them.

    Each subclass also keeps the built-in base that says what kind of failure it is (``ValueError``
    for bad input, ``RuntimeError`` for a failed run, ``TimeoutError`` for a peer that stopped
    answering), so that an ``except`` written for the built-in one keeps catching it.
    """


class ArgumentError(HetpipeError, ValueError):
    """A bad argument, option or environment variable, refused before anything runs: one line naming
    it, the value given and what is allowed."""
