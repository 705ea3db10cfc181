"""Discovery and profiling on each device type, against the old path that measured the host alone and
derived every type by speed ratio.

Runs one mpiexec job of five ranks on this machine: two "hosts" (HETPIPE_HOST), hA with two emu_fast
devices and a rank without a device (a PS slot), hB with two emu_slow devices (HETPIPE_EMULATE).
Rank 0 prints, per device type: which rank measured it, its forward + backward seconds per minibatch
measured on that rank under the type's pacer, the old path's number (this host's time / speed,
derived), the ratio, and the plan made on the discovered cluster. Devices: emulated on this host's
CPU (speeds are fractions of it); nothing here is a real-GPU figure.

    python bench/discovery.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

WORLD = {"HETPIPE_HOST": "hA,hA,hB,hB,hA", "HETPIPE_EMULATE": "emu_fast,emu_fast,emu_slow,emu_slow,ps"}


def model_and_batch():
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 256),
                          nn.Linear(256, 10))
    g = torch.Generator().manual_seed(1)
    return model, torch.randn(128, 256, generator=g), torch.randint(0, 10, (128,), generator=g)


def rank_part() -> None:
    import torch
    from mpi4py import MPI

    from hetpipe.model.measure import profile_model
    from hetpipe.plan import format_plan, make_plan
    from hetpipe.run.profiling import profile_on_devices, profilers, quiet_barrier
    from hetpipe.run.world_plan import discovery_of

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    model, x, y = model_and_batch()
    loss = torch.nn.functional.cross_entropy
    discovery = discovery_of(comm, "auto")
    measured = profile_on_devices(comm, model, (x, y), loss, discovery, repeats=9)
    old = None
    if comm.Get_rank() == 0:
        # The old path: this host measured alone (the others wait without spinning), every type derived.
        old = profile_model(model, x, discovery.cluster, loss_fn=lambda out: loss(out, y), repeats=9)
    quiet_barrier(comm)
    if comm.Get_rank() != 0:
        return
    print(discovery.table())
    print("\nper device type (seconds per minibatch, forward + backward, all layers):")
    print(f"{'type':<10} {'speed':>8} {'measured by':>12} {'measured':>10} {'old: derived':>13} {'ratio':>7}")
    for t, r in profilers(discovery).items():
        got = sum(measured.fwd(t)) + sum(measured.bwd(t))
        was = sum(old.fwd(t)) + sum(old.bwd(t))
        print(f"{t:<10} {discovery.cluster.device_types[t].speed:>8g} {'rank ' + str(r):>12} {got:>10.4f} "
              f"{was:>13.4f} {got / was:>7.3f}")
    print(f"profile source: {measured.source}")
    plan = make_plan(discovery.cluster, measured, nm=2, ps_nodes=[h.host for h in discovery.ps_slots()])
    print()
    print(format_plan(plan, discovery.cluster))
    print("\ndevices: emulated on this host's CPU (not real GPUs)")


def main() -> int:
    if "--rank-part" in sys.argv:
        rank_part()
        return 0
    mpiexec = Path(sys.executable).parent / "mpiexec"
    env = {**os.environ, **WORLD}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1] / "python"),
                                         env.get("PYTHONPATH", "")])
    return subprocess.run([str(mpiexec), "-n", "5", sys.executable, __file__, "--rank-part"], env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
