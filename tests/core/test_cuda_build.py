"""The CUDA build of the core compiles wherever nvcc is found, even on machines without a GPU."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _nvcc():
    cudacxx = os.environ.get("CUDACXX")
    if cudacxx and Path(cudacxx).exists():
        return cudacxx
    return shutil.which("nvcc")


@pytest.mark.slow
def test_cuda_build_compiles(tmp_path):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (set CUDACXX or put nvcc on PATH)")
    if shutil.which("cmake") is None and not (Path(sys.executable).parent / "cmake").exists():
        pytest.skip("cmake not found")
    cmake = shutil.which("cmake") or str(Path(sys.executable).parent / "cmake")
    configure = [cmake, "-S", str(ROOT), "-B", str(tmp_path), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                 "-DHETPIPE_WITH_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90", f"-DCMAKE_CUDA_COMPILER={nvcc}",
                 f"-DPython_EXECUTABLE={sys.executable}"]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.run(configure, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "hetpipe: CUDA ON" in proc.stdout
    build = [cmake, "--build", str(tmp_path), "--target", "hetpipe_core_lib", "_C", "-j", str(os.cpu_count() or 2)]
    proc = subprocess.run(build, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert list(tmp_path.glob("**/_C*.so")) or list(tmp_path.glob("**/_C*.pyd"))
