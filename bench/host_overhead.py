"""hetpipe's host overhead: one VW of 2 stages + 1 PS shard, no device emulation, beside a plain loop.

Both run here, on the host CPU, one torch thread per process, on the same model, minibatches and
optimizer (SGD). hetpipe runs under ``mpiexec -n 3`` (two stage ranks, one PS rank) with pacing off
(``Trainer(emulate=False)``): what it adds to the plain step is the runtime's own cost (instruction
dispatch, weight stashes, message headers and copies, MPI progress, the PS round trip per wave). The
plain loop reads its minibatches from the same ``Batches`` inside its timed loop, as a training
script does.

Steady state: each configuration trains ``short`` and ``long`` minibatches and the time per
minibatch is the difference of the two training times over the difference of their lengths, so
start-up, pipeline fill and drain cancel out; each rank's CPU time (every thread of the process) is
differenced the same way. The plain loop is timed the same way (two lengths), interleaved with the
hetpipe runs.

Rows, each for both stage data planes (``core``: the core's StageEndpoint moves the messages;
``python``: mpi4py requests progressed between instructions, ``HETPIPE_STAGE_PLANE``), at D = 0 and 1:
- tiny: an MLP whose plain step is well under a millisecond. ``overhead/stage`` = hetpipe's time per
  minibatch minus the plain step's share per stage (plain / 2): the fixed cost a stage adds per
  minibatch. Goal: <= 0.3 ms.
- compute: an MLP of six equal blocks and a head, cut 3 | 3 + head, whose plain step is several ms.
  ``speed-up`` = hetpipe samples/s over the plain single-thread loop's. Goal: >= 1.6x on 2 cores.

Two bounds say what limits a row:
- ``sched``: the speed-up the schedule allows with no overhead at all: at D = 0 every wave drains the
  pipeline (a stage's forward of wave c waits for its pull of c), so two balanced stages reach
  2 Nm / (Nm + 1); at D >= 1 they need not drain: 2.
- ``cpu``: the speed-up if the host's cores were busy all the time with the CPU work hetpipe's three
  ranks did per minibatch (cores x plain CPU per minibatch / the ranks' sum): below the goal, the
  runtime's own work is too much for the host, however it is scheduled.

Blocked on pull: the milliseconds per wave each stage's Pull instruction waited for replies that had not
arrived (the runtime's ``WAIT`` trace events; the hetpipe runs keep their trace in memory for them),
stage 0 / stage 1, with pulls requested at the Pull instruction (``before``: ``HETPIPE_PULL_AHEAD=0``, how
every pull went before early pulls) and as soon as WSP allows (``after``, the default), both measured in
the same repetitions.

Two baselines run beside hetpipe, interleaved with it:
- ``host``: two plain loops at once, each in its own process, against one: what the host's cores give
  two independent single-thread processes (shared caches, memory bandwidth, clock), i.e. the best any
  two-process pipeline could reach here.
- ``torch pp``: PyTorch's own pipeline runtime, ``torch.distributed.pipelining`` (Schedule1F1B over
  gloo, 2 ranks), on the same model, cut and minibatches: Nm micro-batches per step, then a flush and
  one SGD step. It has no parameter server and no weight stashes (it steps once per flush), so it
  does less work per minibatch than a WSP stage; its bound is ``sched`` at D = 0. ``vs torch pp``:
  hetpipe's samples/s over the baseline's (goal at D >= 1: >= 1.0x).

    python bench/host_overhead.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple
from hetpipe import Reporting, Runtime

HERE = Path(__file__).resolve()
MODELS = {"tiny": {"width": 32, "depth": 6, "batch": 16},
          "compute": {"width": 448, "depth": 7, "batch": 64}}
GOAL_OVERHEAD_MS = 0.3
GOAL_SPEEDUP = 1.6
GOAL_VS_PIPELINING = 1.0


def _model(name: str):
    import torch
    from torch import nn

    m = MODELS[name]
    torch.manual_seed(0)
    layers: List[nn.Module] = []
    for i in range(m["depth"] - 1):
        layers += [nn.Sequential(nn.Linear(m["width"], m["width"]), nn.ReLU())]
    layers.append(nn.Linear(m["width"], 10))
    return layers


def _data(name: str, n: int):
    import torch

    from hetpipe import Batches

    m = MODELS[name]
    g = torch.Generator().manual_seed(1)
    return Batches(torch.randn(n * m["batch"], m["width"], generator=g),
                   torch.randint(0, 10, (n * m["batch"],), generator=g), m["batch"], seed=1)


def worker(args) -> None:
    """One rank of a hetpipe run: train ``args.n`` minibatches, rank 0 prints the training time. With
    ``args.replay``: the same plan replayed in this one process instead (every stage and the shard,
    stepped in turn over the loopback transport), printing its CPU time."""
    import torch
    from torch import nn

    from hetpipe import Trainer
    from hetpipe.plan.types import Plan, ShardPlan, StagePlan, VirtualWorkerPlan

    torch.set_num_threads(1)
    layers = _model(args.model)
    cut = len(layers) // 2
    stages = (StagePlan("cpu", "cpu", 0, cut, 0.0, 0.0), StagePlan("cpu", "cpu", cut, len(layers), 0.0, 0.0))
    plan = Plan(len(layers), args.nm, args.d, "manual", (VirtualWorkerPlan(0, stages),),
                (ShardPlan(0, "n0", tuple(range(len(layers)))),))
    # The trace stays in memory (its WAIT events give the blocked-on-pull time); its file is discarded.
    trainer = Trainer(layers, nn.functional.cross_entropy, lambda p: torch.optim.SGD(p, lr=0.01),
                      _data(args.model, args.n), plan=plan, epochs=1,
                      reporting=Reporting(progress=False, trace=None if args.replay else os.devnull),
                      runtime=Runtime(emulate=False))
    if args.replay:
        cpu0 = time.process_time()
        trainer.replay()
        print("RESULT " + json.dumps({"cpu_s": [time.process_time() - cpu0]}), flush=True)
        return
    r = trainer.fit()
    if r.rank == 0:
        pulls = args.n // args.nm - 1
        waits = [sum(e.dur_s for e in r.trace if e.kind == "WAIT" and e.vw == 0 and e.stage == s) / pulls * 1e3
                 for s in range(len(stages))]
        print("RESULT " + json.dumps({"elapsed_s": r.elapsed_s, "samples": r.samples, "cpu_s": r.cpu_s,
                                      "pull_wait_ms": waits}), flush=True)


def pipelining(args) -> None:
    """One rank of the baseline pipeline: torch.distributed.pipelining's 1F1B (GPipe's order at Nm = 1,
    which 1F1B refuses) over gloo, 2 ranks, the same model, cut and minibatches as hetpipe's two stages;
    a step is ``args.nm`` micro-batches (one minibatch each), a flush and an SGD step per rank. Trains
    ``args.n`` minibatches after 2 warm-up steps; rank 0 prints the window's wall time and every rank's
    CPU time."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    sys.path.insert(0, str(HERE.parent / "e2e"))
    from mpi_env import gather_results, run_gloo

    if args.n % args.nm:
        raise SystemExit(f"host_overhead: {args.n} minibatches are not whole steps of {args.nm} micro-batches")

    def work(rank: int, world: int) -> None:
        layers = _model(args.model)
        cut = len(layers) // 2
        mine = nn.Sequential(*(layers[:cut] if rank == 0 else layers[cut:]))
        # Every rank passes loss_fn: the schedule's shape inference needs it on all of them. 1F1B needs a
        # micro-batch per stage; with one, GPipe runs the same order (forward, then backward).
        kind = Schedule1F1B if args.nm >= world else ScheduleGPipe
        schedule = kind(PipelineStage(mine, rank, world, torch.device("cpu")), args.nm, loss_fn=nn.functional.cross_entropy)
        opt = torch.optim.SGD(mine.parameters(), lr=0.01)
        warm, steps = 2, args.n // args.nm
        batches = iter(_data(args.model, (warm + steps) * args.nm))
        for i in range(warm + steps):
            if i == warm:
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
            xs, ys = zip(*(next(batches) for _ in range(args.nm)))
            opt.zero_grad(set_to_none=True)
            if rank == 0:
                schedule.step(torch.cat(xs))
            else:
                schedule.step(target=torch.cat(ys))
            opt.step()
        dist.barrier()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        cpus = gather_results({"cpu_s": cpu})
        if rank == 0:
            print("RESULT " + json.dumps({"elapsed_s": wall, "cpu_s": [c["cpu_s"] for c in cpus]}), flush=True)

    run_gloo(work)


def plain(name: str, n: int, gate: bool = False) -> Tuple[float, float]:
    """Wall and CPU seconds of ``n`` plain training steps after 5 warm-up steps, one thread, the
    minibatches read from the data inside the loop. ``gate``: after the warm-up, print "ready" and wait
    for a line on stdin before timing (so that loops started together time the same window)."""
    import torch
    from torch import nn

    torch.set_num_threads(1)
    model = nn.Sequential(*_model(name))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for i, (x, y) in enumerate(_data(name, n + 5)):
        if i == 5:
            if gate:
                print("ready", flush=True)
                sys.stdin.readline()
            t0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return time.perf_counter() - t0, time.process_time() - c0


def _plain_procs(name: str, n: int, count: int = 1) -> Tuple[float, float]:
    """``count`` ``plain`` loops at once, each in a fresh process, as every hetpipe run is (no warm caches
    carried between them): the last one's wall seconds and the processes' CPU seconds summed. Two at
    once: what the host's cores give two independent single-thread loops. Every loop starts its timed
    steps when all have warmed up, so none is timed while another is still starting (importing torch)."""
    code = (f"import sys; sys.path.insert(0, {str(HERE.parent)!r}); import host_overhead as h; "
            f"print(*h.plain({name!r}, {n}, gate=True))")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
             for _ in range(count)]
    ready = [p.stdout.readline().strip() == "ready" for p in procs]
    if all(ready):
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
    outs = [p.communicate(timeout=600) for p in procs]
    if any(p.returncode != 0 for p in procs):
        raise RuntimeError(f"host_overhead: a plain {name} loop failed:\n" + "\n".join(e for _, e in outs))
    walls, cpus = zip(*((float(v) for v in out.split()) for out, _ in outs))
    return max(walls), sum(cpus)


def _run(model: str, nm: int, d: int, n: int, plane: str, ahead: bool = True) -> Dict[str, object]:
    """One hetpipe run under mpiexec on ``plane``, or (``plane`` "replay") replayed in one process, or
    (``plane`` "pipelining") the baseline pipeline's run on 2 ranks; ``ahead``: pulls requested early."""
    from hetpipe.launch.mpiexec import mpiexec_path

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HETPIPE_PULL_AHEAD": "1" if ahead else "0"}
    if plane in PLANES:             # the replay and the baseline have no stage plane to choose
        env["HETPIPE_STAGE_PLANE"] = plane
    else:
        env.pop("HETPIPE_STAGE_PLANE", None)
    args = [sys.executable, str(HERE), "--worker", "--model", model, "--nm", str(nm), "--d", str(d), "--n", str(n)]
    if plane == "replay":
        cmd = args + ["--replay"]
    elif plane == "pipelining":
        cmd = [mpiexec_path(), "-n", "2", *args, "--pipelining"]
    else:
        cmd = [mpiexec_path(), "-n", "3", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"host_overhead: the {model} run (Nm {nm}, D {d}, {plane}) failed:\n"
                       f"{proc.stdout}\n{proc.stderr}")


PLANES = ("python", "core")


def measure(model: str, nm: int, d: int, short: int, long: int, reps: int) -> Dict[str, object]:
    """ms per minibatch (best of ``reps``) of the plain loop, of hetpipe on each stage plane, of the
    baseline pipeline (``pipelining``) and of two plain loops at once (``pair``), with the CPU ms per
    minibatch of each process in the repetition that was best, and the CPU ms per minibatch of the plan
    replayed in one process (``replay``, best of ``reps``); all of them take turns within each repetition."""
    steps = long - short
    out: Dict[str, object] = {"model": model, "nm": nm, "d": d}
    best: Dict[str, Tuple[float, List[float]]] = {}
    waits: Dict[str, List[float]] = {}

    def keep(key: str, wall: Tuple[float, float], cpu: Tuple[List[float], List[float]],
             wait: List[float] = ()) -> None:
        """Keep ``key``'s repetition if its ms per minibatch (``wall``: long, short seconds) is the best;
        ``wait``: the long run's blocked-on-pull ms per wave per stage."""
        ms = (wall[0] - wall[1]) / steps * 1e3
        if key not in best or ms < best[key][0]:
            best[key] = (ms, [(x - y) / steps * 1e3 for x, y in zip(*cpu)])
            if wait:
                waits[key] = list(wait)

    for _ in range(reps):
        (w1, c1), (w0, c0) = _plain_procs(model, long), _plain_procs(model, short)
        keep("plain", (w1, w0), ([c1], [c0]))
        for plane in PLANES:
            for ahead, key in ((False, f"{plane}_before"), (True, plane)):
                a, b = _run(model, nm, d, long, plane, ahead), _run(model, nm, d, short, plane, ahead)
                keep(key, (a["elapsed_s"], b["elapsed_s"]), (a["cpu_s"], b["cpu_s"]), a["pull_wait_ms"])
        a, b = _run(model, nm, d, long, "replay"), _run(model, nm, d, short, "replay")
        keep("replay", (a["cpu_s"][0], b["cpu_s"][0]), (a["cpu_s"], b["cpu_s"]))
        a, b = _run(model, nm, d, long, "pipelining"), _run(model, nm, d, short, "pipelining")
        keep("pipelining", (a["elapsed_s"], b["elapsed_s"]), (a["cpu_s"], b["cpu_s"]))
        (w1, c1), (w0, c0) = _plain_procs(model, long, 2), _plain_procs(model, short, 2)
        keep("pair", (w1, w0), ([c1], [c0]))
    for key, (ms, cpu) in best.items():
        out[f"{key}_ms"], out[f"{key}_cpu_ms"] = ms, cpu
    for key, wait in waits.items():
        out[f"{key}_pull_wait_ms"] = wait
    return out


def sched_bound(nm: int, d: int) -> float:
    """The speed-up of two balanced stages over one process with no overhead (see the module doc)."""
    return 2 * nm / (nm + 1) if d == 0 else 2.0


def table(rows: List[Dict[str, object]]) -> str:
    cores = os.cpu_count() or 1
    lines = [f"hetpipe host overhead: 1 VW x 2 stages + 1 PS (3 ranks), no emulation; devices: host CPU (real), "
             f"{cores} cores, 1 torch thread per process; steady state (two lengths), best of reps",
             f"{'model':8} {'Nm':>3} {'D':>2} {'plain ms/mb':>11} {'CPU':>5} {'plane':>7} {'hetpipe ms/mb':>13} "
             f"{'overhead/stage':>14} {'speed-up':>9} {'CPU ms/mb s0/s1/ps':>19} {'1-proc':>6} {'sched':>6} "
             f"{'cpu':>6} {'host':>6} {'torch pp':>8} {'goal':>16} {'met':>4} {'vs torch pp':>11} "
             f"{'blocked on pull ms/wave s0/s1, before -> after':>46}"]
    for r in rows:
        plain_ms, plain_cpu = r["plain_ms"], r["plain_cpu_ms"][0]
        for plane in PLANES:
            ms, cpu = r[f"{plane}_ms"], r[f"{plane}_cpu_ms"]
            over = ms - plain_ms / 2
            speed = plain_ms / ms
            if r["model"] == "tiny":
                goal, met = f"<= {GOAL_OVERHEAD_MS} ms/stage", over <= GOAL_OVERHEAD_MS
            else:
                goal, met = f">= {GOAL_SPEEDUP}x plain", speed >= GOAL_SPEEDUP
            cpus = "/".join(f"{c:.2f}" for c in cpu)
            before, after = ("/".join(f"{w:.2f}" for w in r[f"{k}_pull_wait_ms"]) for k in (f"{plane}_before", plane))
            vs_pp = r["pipelining_ms"] / ms
            mark = f" ({'met' if vs_pp >= GOAL_VS_PIPELINING else 'not met'})" if r["d"] >= 1 else ""
            lines.append(f"{r['model']:8} {r['nm']:>3} {r['d']:>2} {plain_ms:>11.3f} {plain_cpu:>5.2f} {plane:>7} "
                         f"{ms:>13.3f} {over:>11.3f} ms {speed:>8.2f}x {cpus:>19} {r['replay_ms']:>6.2f} "
                         f"{sched_bound(r['nm'], r['d']):>5.2f}x {cores * plain_cpu / sum(cpu):>5.2f}x "
                         f"{2 * plain_ms / r['pair_ms']:>5.2f}x {plain_ms / r['pipelining_ms']:>7.2f}x {goal:>16} "
                         f"{'yes' if met else 'no':>4} {vs_pp:>10.2f}x{mark} {before:>20} -> {after:<11}")
    lines += ["overhead/stage = hetpipe ms/mb - plain ms/mb / 2; speed-up = plain ms/mb / hetpipe ms/mb",
              "CPU: the plain loop's CPU ms per minibatch; CPU ms/mb: each hetpipe rank's (stage 0, stage 1, PS); "
              "1-proc: the same plan replayed in one process (the runtime's own work: no MPI, no waiting)",
              f"sched: the schedule's bound with no overhead (D = 0 drains the pipeline every wave); "
              f"cpu: {cores} cores x plain CPU / the ranks' CPU (the bound the runtime's CPU work sets)",
              "host: two plain loops at once, each in its own process, over one (what the host's cores allow); "
              "torch pp: the baseline pipeline's speed-up (below)",
              f"vs torch pp: hetpipe's samples/s over the baseline's (goal at D >= 1: >= {GOAL_VS_PIPELINING:.1f}x); "
              "blocked on pull: ms per wave each stage's Pull waited for missing replies, pulls requested at the "
              "Pull instruction (before, HETPIPE_PULL_AHEAD=0, its own runs of the same repetitions) -> as soon as "
              "WSP allows (after); hetpipe ms/mb and the other columns are the after runs'",
              "",
              "baseline pipeline: torch.distributed.pipelining Schedule1F1B (ScheduleGPipe at Nm = 1) over gloo, "
              "2 ranks, the same model, cut and minibatches; a step is Nm micro-batches (one minibatch each), a "
              "flush and an SGD step (so its bound is sched at D = 0)",
              "measured within each row's repetitions (its D is hetpipe's; the baseline has none)",
              f"{'model':8} {'Nm':>3} {'D':>2} {'plain ms/mb':>11} {'torch pp ms/mb':>14} {'overhead/stage':>14} "
              f"{'speed-up':>9} {'CPU ms/mb r0/r1':>16}"]
    for r in rows:
        plain_ms, ms = r["plain_ms"], r["pipelining_ms"]
        cpus = "/".join(f"{c:.2f}" for c in r["pipelining_cpu_ms"])
        lines.append(f"{r['model']:8} {r['nm']:>3} {r['d']:>2} {plain_ms:>11.3f} {ms:>14.3f} "
                     f"{ms - plain_ms / 2:>11.3f} ms {plain_ms / ms:>8.2f}x {cpus:>16}")
    return "\n".join(lines)


CONFIGS = (("tiny", 1, 0), ("tiny", 4, 0), ("tiny", 4, 1), ("compute", 4, 0), ("compute", 4, 1))


def parse_rows(text: str) -> List[Tuple[str, int, int]]:
    """``--rows``: ``MODEL:NM:D`` comma-separated (``tiny:1:0,compute:4:1``); SystemExit naming the item."""
    out = []
    for item in text.split(","):
        parts = item.split(":")
        if len(parts) != 3 or parts[0] not in MODELS or not parts[1].isdigit() or not parts[2].isdigit() \
                or int(parts[1]) < 1:
            raise SystemExit(f"host_overhead: --rows item {item!r} is not MODEL:NM:D (MODEL one of "
                             f"{', '.join(sorted(MODELS))}, NM >= 1, D >= 0)")
        out.append((parts[0], int(parts[1]), int(parts[2])))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="tiny", choices=sorted(MODELS))
    ap.add_argument("--nm", type=int, default=4)
    ap.add_argument("--d", type=int, default=0)
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--replay", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--pipelining", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="short runs, one repetition (a smoke test)")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--rows", default=",".join(f"{m}:{nm}:{d}" for m, nm, d in CONFIGS),
                    help="the rows to measure, MODEL:NM:D comma-separated (default: all five)")
    args = ap.parse_args()
    if args.worker:
        pipelining(args) if args.pipelining else worker(args)
        return
    reps = 1 if args.quick else 3
    # Even the quick run's difference of lengths must outweigh the noise of a run's start-up (tens of ms here).
    lengths = {"tiny": (20, 140) if args.quick else (100, 500), "compute": (8, 32) if args.quick else (40, 200)}
    rows = [measure(model, nm, d, *lengths[model], reps) for model, nm, d in parse_rows(args.rows)]
    print(table(rows), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
