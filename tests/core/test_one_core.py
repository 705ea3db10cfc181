"""One copy of the compiled core per process: both extension modules link the shared libhetpipe_core.so
beside them (csrc/CMakeLists.txt), so objects made through one are the objects the other serves."""

import subprocess
import sys
from pathlib import Path

import pytest

import hetpipe_core

PKG = Path(hetpipe_core.__file__).resolve().parent

CHECK = r"""
import sys
import hetpipe_core
modules = ["_C"]
if hetpipe_core.build_info()["mpi_built"]:
    import mpi4py.MPI  # loads the libmpi hetpipe_core._mpi links
    from hetpipe_core import _mpi
    modules.append("_mpi")
maps = [line.split()[-1] for line in open("/proc/self/maps") if len(line.split()) >= 6]
cores = sorted({p for p in maps if p.endswith("/libhetpipe_core.so")})
mods = sorted({p.rsplit("/", 1)[-1].split(".")[0] for p in maps if "/hetpipe_core/_" in p})
print(repr((cores, mods, modules)))
"""


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps (Linux)")
def test_both_modules_share_one_core_library():
    proc = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    cores, mapped, modules = eval(proc.stdout.strip().splitlines()[-1])
    assert mapped == sorted(modules)
    assert cores == [str(PKG / "libhetpipe_core.so")], f"core libraries mapped: {cores}"


def test_modules_carry_no_core_of_their_own():
    """The core's code lives in the library: a symbol only the core defines is not in the modules' files."""
    marker = b"PinnedBufferPool: too many slots"   # a string of the core's own error messages
    lib = (PKG / "libhetpipe_core.so").read_bytes()
    assert marker in lib
    for module in PKG.glob("_*.so"):
        assert marker not in module.read_bytes(), f"{module.name} holds a copy of the core"
