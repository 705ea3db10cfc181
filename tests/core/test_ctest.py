"""The C++ tests of the core (csrc/tests, run by ctest) build and pass, plain and under ThreadSanitizer.

They drive the pool, the clock table and the streams from many C++ threads at once, which no test
through the GIL can; ThreadSanitizer reports any data race those threads hit. Each variant configures
its own build of the core alone (no Python module, no CUDA) in a temporary directory.
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
    configure = [cmake, "-S", str(ROOT), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                 "-DHETPIPE_BUILD_TESTS=ON", "-DHETPIPE_BUILD_PYTHON=OFF", "-DHETPIPE_WITH_CUDA=OFF",
                 f"-DHETPIPE_SANITIZE={sanitize}"]
    proc = _run(configure, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = _run([cmake, "--build", str(build), "--target", "test_core", "-j", "2"], timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return _run([ctest, "--test-dir", str(build), "--output-on-failure", "--timeout", "120"], timeout=180,
                env=env or {})


@pytest.mark.slow
def test_ctest_passes(tmp_path):
    proc = _build_and_ctest(tmp_path, "")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert "100% tests passed" in proc.stdout


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


@pytest.mark.slow
def test_ctest_passes_under_thread_sanitizer(tmp_path):
    if not _tsan_usable(tmp_path):
        pytest.skip("the C++ compiler cannot build or run a ThreadSanitizer program on this machine")
    proc = _build_and_ctest(tmp_path / "build", "thread", env={"TSAN_OPTIONS": "halt_on_error=1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-8000:]
    assert "ThreadSanitizer" not in out, out[-8000:]
    assert "100% tests passed" in proc.stdout
