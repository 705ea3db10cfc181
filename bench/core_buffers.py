"""PinnedBufferPool: acquire/release latency beside allocating a fresh buffer; on a GPU, pinned vs.
pageable host<->device bandwidth and copy/compute overlap with two streams.

    .venv/bin/python bench/core_buffers.py
"""

import time

import numpy as np

import hetpipe_core
from hetpipe_core import Event, PinnedBufferPool, Stream, copy_async

KIB, MIB = 1 << 10, 1 << 20


def per_call_us(fn, iters: int) -> float:
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - start) / iters)
    return best * 1e6


def latency_table(devices: str, device: int) -> None:
    print("pool: one acquire()+release() pair from Python; baselines: one fresh allocation of the same size")
    print(f"(np.empty leaves pages untouched; np.zeros/bytearray fill them); devices: {devices}")
    header = f"{'slot size':>10}{'pool us':>10}{'np.empty us':>13}{'np.zeros us':>13}{'bytearray us':>14}"
    print(header)
    print("-" * len(header))
    for size in (4 * KIB, 64 * KIB, 1 * MIB, 16 * MIB):
        pool = PinnedBufferPool(4, size, device)
        iters = 20000 if size <= 64 * KIB else 2000

        def pool_op():
            pool.release(pool.acquire())

        pool_us = per_call_us(pool_op, iters)
        empty_us = per_call_us(lambda: np.empty(size, np.uint8), iters)
        zeros_us = per_call_us(lambda: np.zeros(size, np.uint8), max(iters // 10, 100))
        bytes_us = per_call_us(lambda: bytearray(size), max(iters // 10, 100))
        label = f"{size // KIB} KiB" if size < MIB else f"{size // MIB} MiB"
        print(f"{label:>10}{pool_us:>10.2f}{empty_us:>13.2f}{zeros_us:>13.2f}{bytes_us:>14.2f}")


def gpu_tables() -> None:
    import torch

    print()
    print("host<->device bandwidth, GB/s, best of 5; devices: real CUDA")
    print("ours: copy_async from/to a pool slot on a core Stream; pageable: the same from/to np.ones;")
    print("cudaMemcpy ref: torch's copy_(non_blocking=True) with a torch pin_memory tensor on a torch stream")
    header = (f"{'size':>10}{'H2D ours':>10}{'H2D ref':>9}{'ours/ref':>9}{'H2D pageable':>13}{'pin/page':>9}"
              f"{'D2H ours':>10}{'D2H ref':>9}{'ours/ref':>9}{'D2H pageable':>13}{'pin/page':>9}")
    print(header)
    print("-" * len(header))
    s = Stream(0)
    ref_stream = torch.cuda.Stream()
    worst = float("inf")
    size = 4 * KIB
    while size <= 256 * MIB:
        pool = PinnedBufferPool(1, size, 0)
        pinned = pool.acquire()
        pageable = np.ones(size, np.uint8)
        dev = torch.empty(size, dtype=torch.uint8, device="cuda")
        ref_host = torch.ones(size, dtype=torch.uint8, pin_memory=True)
        reps = max(1, min(100, (64 * MIB) // size))

        def best_rate(issue, sync):
            best = float("inf")
            for _ in range(5):
                sync()
                start = time.perf_counter()
                for _ in range(reps):
                    issue()
                sync()
                best = min(best, (time.perf_counter() - start) / reps)
            return size / best / 1e9

        def ours(dst, src):
            return best_rate(lambda: copy_async(dst, src, size, s), s.synchronize)

        def ref(dst, src):
            def issue():
                with torch.cuda.stream(ref_stream):
                    dst.copy_(src, non_blocking=True)
            return best_rate(issue, ref_stream.synchronize)

        h2d = ours(dev.data_ptr(), pinned), ref(dev, ref_host), ours(dev.data_ptr(), pageable)
        d2h = ours(pinned, dev.data_ptr()), ref(ref_host, dev), ours(pageable, dev.data_ptr())
        if size >= MIB:
            worst = min(worst, h2d[0] / h2d[1], d2h[0] / d2h[1])
        label = f"{size // KIB} KiB" if size < MIB else f"{size // MIB} MiB"
        row = f"{label:>10}"
        for ours_, ref_, page in (h2d, d2h):
            row += f"{ours_:>10.2f}{ref_:>9.2f}{ours_ / ref_:>8.2f}x{page:>13.2f}{ours_ / page:>8.1f}x"
        print(row)
        del dev, ref_host
        size *= 4
    s.close()
    print(f"pinned copies from 1 MiB up: worst ours/ref = {worst:.2f} (target >= 0.90)")

    print()
    print("copy/compute overlap: H2D copies on a copy stream while matmuls run on a compute stream")
    copy_stream, compute_stream = Stream(0), Stream(0)
    n = 64 * MIB
    pool = PinnedBufferPool(1, n, 0)
    src = pool.acquire()
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    x = torch.randn(4096, 4096, device="cuda")
    torch_compute = torch.cuda.ExternalStream(compute_stream.handle)

    def copies():
        for _ in range(8):
            copy_async(dev.data_ptr(), src, n, copy_stream)

    def compute():
        with torch.cuda.stream(torch_compute):
            for _ in range(20):
                x @ x

    def timed(fn):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        copy_stream.synchronize()
        compute_stream.synchronize()
        return time.perf_counter() - start

    timed(lambda: (copies(), compute()))
    t_copy, t_compute = timed(copies), timed(compute)
    t_both = timed(lambda: (copies(), compute()))
    hidden = (t_copy + t_compute - t_both) / min(t_copy, t_compute) * 100
    print(f"{'copy s':>10}{'compute s':>11}{'both s':>9}{'overlap %':>11}")
    print(f"{t_copy:>10.4f}{t_compute:>11.4f}{t_both:>9.4f}{hidden:>10.0f}%")
    e = Event()
    e.record(copy_stream)
    e.synchronize()
    copy_stream.close()
    compute_stream.close()


def main() -> None:
    info = hetpipe_core.build_info()
    has_gpu = info["cuda_available"]
    if has_gpu:
        try:
            import torch

            has_gpu = torch.cuda.is_available()
        except ImportError:
            has_gpu = False
    devices = "real CUDA device, pinned slots" if has_gpu else "no CUDA device: aligned pageable host memory"
    latency_table(devices, 0 if has_gpu else -1)
    if has_gpu:
        gpu_tables()
    else:
        print()
        print(f"GPU parts skipped (no device: cuda_built={info['cuda_built']}, "
              f"cuda_device_count={info['cuda_device_count']}): pinned vs pageable H2D/D2H bandwidth "
              "and copy/compute overlap need a CUDA device and torch with CUDA.")


if __name__ == "__main__":
    main()
