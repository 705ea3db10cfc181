"""The NumPy front end: a NumPy program trains through WSP's parameter servers, no torch needed.

``WSPWorker(comm, plan, layer_weights)`` on each stage rank (one-stage virtual workers), with
``step``, ``push``, ``pull`` and ``done``; ``serve_shard(comm, plan, layer_weights)`` on each PS rank.
Run a rank's part under ``with aborting(comm):`` so that its failure ends the job at once, naming it.
"""

from hetpipe.job.failure import aborting
from hetpipe.numpy.worker import WSPWorker
from hetpipe.ps.serve import ShardOutcome, serve_shard

__all__ = ["WSPWorker", "serve_shard", "ShardOutcome", "aborting"]
