"""Every exception class of the package derives from ``hetpipe.HetpipeError`` and keeps its built-in base.

The classes are found by importing every module of the package, so that a new exception that forgets
the common base fails here, named.
"""

import importlib
import inspect
import pickle
import pkgutil

import pytest

import hetpipe
from hetpipe import HetpipeError

# The built-in base each class had before the common one: an ``except`` written for it must keep working.
BUILTIN_BASE = {
    "hetpipe.adapters.errors.AdapterError": ValueError,
    "hetpipe.checkpoint.format.CheckpointError": RuntimeError,
    "hetpipe.job.discovery.DiscoveryError": ValueError,
    "hetpipe.job.launch_file.LaunchFileError": ValueError,
    "hetpipe.job.roles.LaunchError": RuntimeError,
    "hetpipe.job.world.MPIUnavailable": RuntimeError,
    "hetpipe.launch.hosts.HostsError": ValueError,
    "hetpipe.loader.check.DataMismatch": ValueError,
    "hetpipe.ps.shard.WSPViolation": RuntimeError,
    "hetpipe.run.profiling.ProfilingError": RuntimeError,
    "hetpipe.run.record.RecordMismatch": ValueError,
    "hetpipe.run.replay.ReplayDeadlock": RuntimeError,
    "hetpipe.schedule.validate.ScheduleError": ValueError,
    "hetpipe.transport.drive.PeerTimeout": TimeoutError,
    "hetpipe.transport.protocol.TransportError": RuntimeError,
    "hetpipe.transport.protocol.StageError": RuntimeError,
    "hetpipe.transport.registry.TransportChoiceError": ValueError,
    "hetpipe.transport.slots.PinningError": RuntimeError,
    "hetpipe.util.errors.ArgumentError": ValueError,
}


def _classes(namespace, module: str):
    """The classes defined in ``module`` found in ``namespace``, and those nested in them."""
    for obj in list(vars(namespace).values()):
        if inspect.isclass(obj) and obj.__module__ == module:
            yield obj
            if obj is not namespace:
                yield from _classes(obj, module)


def exception_classes():
    """``{"module.QualName": class}`` of every exception class defined in the package (warning categories,
    which are not raised as failures, aside)."""
    found = {}
    for info in pkgutil.walk_packages(hetpipe.__path__, "hetpipe."):
        module = importlib.import_module(info.name)
        for cls in _classes(module, module.__name__):
            if issubclass(cls, BaseException) and not issubclass(cls, Warning):
                found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return found


@pytest.fixture(scope="module")
def found():
    return exception_classes()


def test_the_walk_finds_the_known_exceptions(found):
    missing = sorted(set(BUILTIN_BASE) - set(found))
    assert not missing, f"exception classes the walk did not find: {missing}"
    assert found["hetpipe.util.errors.HetpipeError"] is HetpipeError is hetpipe.HetpipeError


def test_every_exception_derives_from_hetpipe_error(found):
    strays = sorted(name for name, cls in found.items() if not issubclass(cls, HetpipeError))
    assert not strays, f"exception classes that do not derive from hetpipe.HetpipeError: {strays}"


@pytest.mark.parametrize("name", sorted(BUILTIN_BASE))
def test_each_keeps_its_builtin_base(found, name):
    cls = found[name]
    assert issubclass(cls, BUILTIN_BASE[name]), f"{name} no longer derives from {BUILTIN_BASE[name].__name__}"
    # Raised, caught by either base, and sent between processes (pickled) whole.
    for base in (HetpipeError, BUILTIN_BASE[name]):
        with pytest.raises(base, match="^the message$"):
            raise cls("the message")
    again = pickle.loads(pickle.dumps(cls("the message")))
    assert type(again) is cls and str(again) == "the message"


def test_a_raised_error_is_caught_by_the_common_base_and_its_own(tmp_path):
    from hetpipe.checkpoint.format import find

    with pytest.raises(HetpipeError, match="no complete checkpoint"):
        find(tmp_path)
    with pytest.raises(RuntimeError, match="no complete checkpoint"):
        find(tmp_path)
