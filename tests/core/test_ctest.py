"""The C++ tests of the core (csrc/tests, run by ctest) build and pass under ThreadSanitizer and AddressSanitizer.

They drive the pool, the clock table and the streams from many C++ threads at once, which no test
through the GIL can; ThreadSanitizer reports any data race those threads hit. With an MPI (the
environment's MPICH), ``test_mpi_loopback`` also runs the MPI data planes in one process under
mpiexec: a StageEndpoint sending to itself, and a ShardService serving an endpoint of the same rank,
every thread of both live at once. The test configures its own build of the core alone (no Python
module, no CUDA) in a temporary directory, instrumented with ThreadSanitizer where the compiler can
build and run it here, plain otherwise, and once more under AddressSanitizer. Each build is made once
per test session (a session fixture) and shared by the tests reading its ctest output; they are
``slow``, outside the unit tier.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    here = BIN / name
    found = str(here) if here.exists() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} not found beside the Python interpreter nor on PATH")
    return found


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", **kw.pop("env", {})}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, **kw)


def _build_and_ctest(build: Path, sanitize: str, env=None) -> subprocess.CompletedProcess:
    cmake, ctest = _tool("cmake"), _tool("ctest")
    # -O1: compiles faster than Release and keeps ThreadSanitizer's reports exact.
    configure = [cmake, "-S", str(ROOT), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                 "-DCMAKE_CXX_FLAGS_RELEASE=-O1",
                 "-DHETPIPE_BUILD_TESTS=ON", "-DHETPIPE_BUILD_PYTHON=OFF", "-DHETPIPE_WITH_CUDA=OFF",
                 f"-DHETPIPE_SANITIZE={sanitize}"]
    if (BIN / "mpiexec").exists():
        configure.append(f"-DMPI_HOME={sys.prefix}")     # the environment's MPICH, as setup.py does
    proc = _run(configure, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = _run([cmake, "--build", str(build), "-j", "2"], timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return _run([ctest, "--test-dir", str(build), "--output-on-failure", "--timeout", "120"], timeout=180,
                env=env or {})


def _check_loopback_ran(build: Path, out: str) -> None:
    """With MPI built, the MPI loopback test must have run (and passed), not been left out."""
    if "HETPIPE_MPI_BUILT:INTERNAL=ON" not in (build / "CMakeCache.txt").read_text():
        pytest.skip("the core was built without MPI: there is no loopback test")
    assert "test_mpi_loopback ...." in out and "Passed" in out.split("test_mpi_loopback ....", 1)[1][:80], out


def _tsan_usable(tmp_path: Path) -> bool:
    """Whether this compiler builds and runs a ThreadSanitizer program here (some kernels' address
    layouts defeat older TSan runtimes)."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        return False
    src = tmp_path / "probe.cc"
    src.write_text("#include <thread>\nint main() { std::thread t([] {}); t.join(); }\n")
    exe = tmp_path / "probe"
    if _run([cxx, "-fsanitize=thread", "-pthread", str(src), "-o", str(exe)], timeout=120).returncode != 0:
        return False
    return _run([str(exe)], timeout=60).returncode == 0


@pytest.fixture(scope="session")
def tsan_ctest(tmp_path_factory):
    """The core's C++ tests built and run once per session, under ThreadSanitizer where usable (plain
    otherwise): (build directory, ctest's completed process)."""
    tmp = tmp_path_factory.mktemp("tsan")
    sanitize = "thread" if _tsan_usable(tmp) else ""
    return tmp / "build", _build_and_ctest(tmp / "build", sanitize, env={"TSAN_OPTIONS": "halt_on_error=1"})


@pytest.mark.slow
def test_ctest_passes(tsan_ctest):
    _, proc = tsan_ctest
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-8000:]
    assert "WARNING: ThreadSanitizer" not in out, out[-8000:]
    assert "100% tests passed" in proc.stdout


@pytest.mark.slow
def test_mpi_loopback_ran_under_thread_sanitizer(tsan_ctest):
    build, proc = tsan_ctest
    _check_loopback_ran(build, proc.stdout)


def _asan_usable(tmp_path: Path) -> bool:
    """Whether this compiler builds and runs an AddressSanitizer program here."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        return False
    src = tmp_path / "probe.cc"
    src.write_text("#include <vector>\nint main() { std::vector<int> v(4); return v[3]; }\n")
    exe = tmp_path / "probe"
    if _run([cxx, "-fsanitize=address", str(src), "-o", str(exe)], timeout=120).returncode != 0:
        return False
    return _run([str(exe)], timeout=60).returncode == 0


@pytest.fixture(scope="session")
def asan_ctest(tmp_path_factory):
    """The same C++ tests built and run once per session under AddressSanitizer (and LeakSanitizer)."""
    tmp = tmp_path_factory.mktemp("asan")
    if not _asan_usable(tmp):
        pytest.skip("AddressSanitizer does not build or run with this compiler here")
    return tmp / "build", _build_and_ctest(tmp / "build", "address",
                                           env={"ASAN_OPTIONS": "detect_leaks=1:halt_on_error=1"})


@pytest.mark.slow
def test_ctest_passes_under_address_sanitizer(asan_ctest):
    """No out-of-bounds access, use after free or leak."""
    _, proc = asan_ctest
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-8000:]
    assert "ERROR: AddressSanitizer" not in out and "ERROR: LeakSanitizer" not in out, out[-8000:]
    assert "100% tests passed" in proc.stdout


@pytest.mark.slow
def test_mpi_loopback_ran_under_address_sanitizer(asan_ctest):
    build, proc = asan_ctest
    _check_loopback_ran(build, proc.stdout)
