"""Test-wide rules: tests marked ``gpu`` need a usable CUDA device.

Without one they are skipped, unless HETPIPE_REQUIRE_GPU=1 (GPU CI), where a missing device fails them.
"""

import os

import pytest


def _cuda_available() -> bool:
    try:
        import hetpipe_core
    except ImportError:
        return False
    return bool(hetpipe_core.build_info()["cuda_available"])


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is None or _cuda_available():
        return
    if os.environ.get("HETPIPE_REQUIRE_GPU") == "1":
        pytest.fail("HETPIPE_REQUIRE_GPU=1 but no usable CUDA device: hetpipe_core.build_info() reports "
                    "cuda_available=False (is the core built with CUDA, and is a device visible?)", pytrace=False)
    pytest.skip("needs a CUDA device (hetpipe_core.build_info()['cuda_available'] is False)")
