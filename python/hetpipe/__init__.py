"""hetpipe: train large DNNs on clusters of mixed GPUs with pipelined virtual workers and WSP."""

from hetpipe.util.errors import HetpipeError

__version__ = "0.1.0"

# The runtime needs torch; load it only when one of these names is first used, so `import hetpipe`
# stays light (the planner, schedules and the CLI work without torch).
_LAZY = {
    "Trainer": "hetpipe.run.trainer",
    "TrainResult": "hetpipe.run.result",
    "Batches": "hetpipe.run.data",
    "DatasetSource": "hetpipe.loader.source",
    "StreamSource": "hetpipe.loader.source",
    "PerVWSource": "hetpipe.loader.source",
    "Plan": "hetpipe.plan.types",
    "named_params": "hetpipe.model.names",
    "EarlyStopping": "hetpipe.run.callbacks",
    "BestEvaluation": "hetpipe.run.callbacks",
    "RunShape": "hetpipe.run.shape",
    "heartbeat": "hetpipe.job.rundir",
    "Callback": "hetpipe.run.callbacks",
    "Planning": "hetpipe.run.config",
    "PSRule": "hetpipe.run.config",
    "Numerics": "hetpipe.run.config",
    "Checkpointing": "hetpipe.run.config",
    "Reporting": "hetpipe.run.config",
    "Runtime": "hetpipe.run.config",
    "HetpipeDeprecationWarning": "hetpipe.run.config",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hetpipe' has no attribute {name!r}")


__all__ = ["Trainer", "TrainResult", "Batches", "DatasetSource", "StreamSource", "PerVWSource", "Plan", "named_params",
           "EarlyStopping", "BestEvaluation", "Callback", "RunShape", "heartbeat",
           "Planning", "PSRule", "Numerics", "Checkpointing", "Reporting", "Runtime", "HetpipeDeprecationWarning",
           "HetpipeError", "__version__"]
