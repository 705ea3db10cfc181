"""bench/gpu_check.sh parses, and names its phases when called without one (it runs one phase per command)."""

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.sh"


@pytest.fixture
def bash():
    found = shutil.which("bash")
    if found is None:
        pytest.skip("no bash")
    return found


def test_the_script_parses(bash):
    proc = subprocess.run([bash, "-n", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_one_phase_per_command(bash, tmp_path):
    for args in ([], ["probe", "tests"]):
        proc = subprocess.run([bash, str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                              env={"OUT": str(tmp_path), "PATH": "/usr/bin:/bin"})
        assert proc.returncode == 2
        assert "usage: bash bench/gpu_check.sh wheels|probe|tests|bench-tied|bench-untied" in proc.stderr
