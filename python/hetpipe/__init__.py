"""hetpipe: train large DNNs on clusters of mixed GPUs with pipelined virtual workers and WSP."""

__version__ = "0.1.0"
