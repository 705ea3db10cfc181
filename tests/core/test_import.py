"""hetpipe_core imports without torch (and reports what it was built with)."""

import subprocess
import sys
import textwrap

import hetpipe_core


def test_build_info_keys():
    info = hetpipe_core.build_info()
    assert set(info) >= {"version", "cuda_built", "cuda_available", "cuda_device_count"}
    assert info["version"] == hetpipe_core.__version__
    assert info["cuda_available"] == (info["cuda_device_count"] > 0)
    if not info["cuda_built"]:
        assert not info["cuda_available"]


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
        print("OK", hetpipe_core.build_info()["version"])
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("OK ")
