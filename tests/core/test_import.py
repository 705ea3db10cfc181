"""hetpipe_core imports without torch (and reports what it was built with)."""

import shutil
import subprocess
import sys
import textwrap

import pytest

import hetpipe_core


def test_build_info_keys():
    info = hetpipe_core.build_info()
    assert set(info) >= {"version", "cuda_built", "cuda_available", "cuda_device_count", "mpi_built"}
    assert info["version"] == hetpipe_core.__version__
    assert info["cuda_available"] == (info["cuda_device_count"] > 0)
    if not info["cuda_built"]:
        assert not info["cuda_available"]


def test_the_api_is_explicit_and_holds_no_bench_helper():
    """Every public name of the compiled module is either API (hetpipe_core.__all__) or a benchmark
    helper (hetpipe_core.bench), never both; a new binding must be placed in one of them."""
    from hetpipe_core import _C, bench

    api, helpers = set(hetpipe_core.__all__), set(bench.__all__)
    assert not api & helpers, sorted(api & helpers)
    assert [n for n in sorted(api) if not hasattr(hetpipe_core, n)] == []
    assert [n for n in sorted(helpers) if not hasattr(bench, n)] == []
    assert [n for n in sorted(helpers) if hasattr(hetpipe_core, n)] == []
    compiled = {n for n in dir(_C) if not n.startswith("_")}
    assert compiled == api | helpers, f"in neither: {sorted(compiled - api - helpers)}; " \
                                      f"not compiled: {sorted(api | helpers - compiled)}"


def test_import_without_torch():
    code = textwrap.dedent("""
        import sys

        class BlockTorch:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("torch is blocked in this test")
                return None

        sys.meta_path.insert(0, BlockTorch())
        try:
            import torch  # noqa: F401
        except ImportError:
            pass
        else:
            raise SystemExit("the blocker did not block torch")
        import hetpipe_core
        pool = hetpipe_core.PinnedBufferPool(2, 64)
        slot = pool.acquire()
        memoryview(slot)[0] = 1
        pool.release(slot)
        t = hetpipe_core.ClockTable(2)
        t.advance(0)
        s = hetpipe_core.Stream()
        s.synchronize()
        s.close()
        assert "torch" not in sys.modules
        # Nor does it load MPI: the MPI service is the separate extension hetpipe_core._mpi.
        assert "mpi4py" not in sys.modules and "hetpipe_core._mpi" not in sys.modules
        with open("/proc/self/maps") as maps:
            assert "libmpi" not in maps.read()
        print("OK", hetpipe_core.build_info()["version"])
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("OK ")


def test_module_keeps_its_static_code_private():
    """The module exports PyInit__C, not the core's symbols nor those of a statically linked
    libstdc++: exported, they would be bound to another extension's copies (torch's libstdc++),
    which crashed formatting an error message once torch was imported."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("binutils' nm is not installed")
    out = subprocess.run([nm, "-D", "--defined-only", hetpipe_core._C.__file__], capture_output=True, text=True,
                         check=True).stdout
    names = [line.split()[-1] for line in out.splitlines() if line.strip()]
    assert "PyInit__C" in names
    leaked = [n for n in names if "7hetpipe" in n or "6locale" in n or "codecvt" in n]
    assert not leaked, leaked[:10]


def test_errors_format_after_torch_is_imported():
    pytest.importorskip("torch")
    code = textwrap.dedent("""
        import torch
        import hetpipe_core
        pool = hetpipe_core.PinnedBufferPool(1, 64)
        held = pool.acquire()
        try:
            pool.acquire(timeout=0)
        except TimeoutError as e:
            assert "all 1 slots of 64 bytes" in str(e), e
        try:
            pool.acquire(nbytes=65)
        except ValueError as e:
            assert "65" in str(e), e
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_mpi_extension_built_where_the_environment_has_mpi():
    """setup.py points CMake at the environment's MPICH (the library mpi4py loads): there, the build
    must hold hetpipe_core._mpi, linked to that very library."""
    from pathlib import Path

    if not (Path(sys.prefix) / "include" / "mpi.h").exists():
        pytest.skip("no MPI headers in this Python environment")
    assert hetpipe_core.build_info()["mpi_built"]
    code = "from mpi4py import MPI; from hetpipe_core import _mpi; print(_mpi.library_version() == MPI.Get_library_version())"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "True", proc.stderr[-2000:]
