"""Profiling each device type on the rank that holds it. Usage: profile_types.py; rank 0 prints a
``RESULT`` per profiling rank with the type it measured, the profile's seconds per minibatch for it (forward +
backward over all layers, as the whole world received them) and its own measurement: the layers'
time on the bare host, and their time under the pacer of the emulated type."""

import json
import sys

from mpi4py import MPI

from common import cross_entropy, mlp, synthetic
from hetpipe.model.measure import measure_layers
from hetpipe.run.profiling import profile_on_devices, profilers
from hetpipe.run.world_plan import discovery_of


def main() -> int:
    comm = MPI.COMM_WORLD
    model = mlp(width=256)
    x, y = next(iter(synthetic(n=256, batch=64)))
    discovery = discovery_of(comm, "auto")
    profile = profile_on_devices(comm, model, (x, y), cross_entropy, discovery, repeats=9)
    mine = []
    for t, r in profilers(discovery).items():
        if r == comm.Get_rank():
            speed = discovery.cluster.device_types[t].speed
            paced = measure_layers(model, x, loss_fn=lambda out: cross_entropy(out, y), repeats=9, speed=speed)
            mine.append({
                "type": t, "speed": discovery.cluster.device_types[t].speed,
                "profiled": sum(profile.fwd(t)) + sum(profile.bwd(t)),
                "host": sum(m.host_s for m in paced.layers), "paced": sum(m.fwd_s + m.bwd_s for m in paced.layers),
                "derived": any(layer.derived.get(t, True) for layer in profile.layers),
                "source": profile.source})
    everyone = comm.gather(mine, root=0)    # one writer: lines of several ranks would interleave
    if comm.Get_rank() == 0:
        for entry in (e for part in everyone for e in part):
            print("RESULT " + json.dumps(entry), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
