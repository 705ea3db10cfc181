"""Command line: `hetpipe plan | simulate | launch | export | info`."""

import argparse
import dataclasses
import sys

from hetpipe.util.numbers import arg_seconds, arg_whole, number


class _Parser(argparse.ArgumentParser):
    """argparse, refusing a bad command line in one line (``hetpipe <command>: <message>``), exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def main(argv=None) -> int:
    parser = _Parser(prog="hetpipe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="what the compiled core contains")
    _add_plan_command(sub)
    _add_simulate_command(sub)
    _add_launch_command(sub)
    _add_export_command(sub)
    args = parser.parse_args(argv)
    if args.command == "plan":
        return _run_plan(args)
    if args.command == "simulate":
        return _run_simulate(args)
    if args.command == "launch":
        return _run_launch(args)
    if args.command == "export":
        return _run_export(args)
    if args.command == "info":
        import hetpipe_core
        print(hetpipe_core.build_info())
    return 0


def _add_plan_command(sub) -> None:
    p = sub.add_parser("plan", help="plan VWs, stages, Nm and PS shards for a model on a cluster")
    p.add_argument("--cluster", required=True, help="cluster preset name, JSON file, or auto: discover the devices "
                                                     "of the MPI world this runs in (mpiexec -n N hetpipe plan ...)")
    p.add_argument("--profile", required=True, help="model profile preset name or JSON file (types it lacks are "
                                                     "modelled from peak FLOP/s or derived by speed ratio, and said so)")
    p.add_argument("--save-cluster", metavar="FILE", help="write the cluster as JSON (default with --cluster auto: "
                                                          "cluster.json)")
    p.add_argument("--policy", default="auto", help="VW formation: NP, ED, HD or auto (default)")
    p.add_argument("--nm", type=arg_whole("--nm"), help="minibatches in flight per VW (default: chosen by the planner)")
    p.add_argument("--d", type=arg_whole("--d", 0), default=0, help="WSP staleness bound D (default 0)")
    p.add_argument("--waves", choices=("equal", "speed"), default="equal",
                   help="minibatches per wave of each VW: equal (Nm each, the default) or speed (proportional to "
                        "the VW's predicted speed; the PS weighs the deltas by their samples)")
    p.add_argument("--recompute", choices=("none", "fit", "all"), default="none",
                   help="recompute activations: never, only to fit memory, or on every stage")
    p.add_argument("--ps-shards", type=arg_whole("--ps-shards"), help="number of parameter-server shards (default: one per node)")
    p.add_argument("--precision", choices=("fp32", "tf32", "bf16", "fp16"), default="fp32",
                   help="bf16/fp16: autocast compute and half-precision activations on the wire (half the "
                        "transfer bytes; fp16 with dynamic loss scaling); tf32: an fp32 run whose matmuls use "
                        "TF32 tensor cores (devices at their TF32 peak)")
    p.add_argument("--aggregate", choices=("mean", "sum"), default="mean",
                   help="how the PS combines the VWs' wave deltas: their mean (default) or their sum (HetPipe's)")
    p.add_argument("--outer", choices=("sgd", "nesterov", "delayed-nesterov"), default="sgd",
                   help="the PS's outer optimizer on each wave's aggregated delta: sgd (default; with lr 1 the plain "
                        "rule), nesterov (DiLoCo's outer step, a momentum buffer per shard) or delayed-nesterov "
                        "(each push applied at once, a momentum step every --outer-delay pushes)")
    p.add_argument("--outer-lr", type=float, default=1.0, help="the outer optimizer's learning rate (default 1)")
    p.add_argument("--outer-momentum", type=float, default=0.9,
                   help="nesterov's and delayed-nesterov's momentum, in [0, 1) (default 0.9)")
    p.add_argument("--outer-staleness", choices=("none", "inverse", "sqrt"), default="none",
                   help="divide a push computed on weights s waves old by 1 + s (inverse) or sqrt(1 + s) (sqrt) "
                        "(default none)")
    p.add_argument("--outer-gain", choices=("none", "sqrt"), default="none",
                   help="sqrt: divide each push by sqrt(VW count) instead of --aggregate's count or 1 (default none)")
    p.add_argument("--outer-delay", type=int, default=0,
                   help="delayed-nesterov: pushes of a layer per momentum step (default 0: the VW count)")
    p.add_argument("--objective", choices=("throughput", "memory_efficiency", "time-to-accuracy"),
                   default="throughput",
                   help="what the plan maximises: predicted samples/s (default), Hippie's memory efficiency, or "
                        "time-to-accuracy: goodput (samples/s x statistical efficiency of the batch per update) "
                        "over every policy, one-device VWs, one VW of every device and the cluster without its "
                        "slowest devices; prints the candidates (needs --noise-scale)")
    p.add_argument("--noise-scale", metavar="B", help="time-to-accuracy: the gradient noise scale in samples "
                                                       "(hetpipe.run.pilot.measure_noise_scale measures it)")
    p.add_argument("--base-batch", metavar="M0", help="time-to-accuracy: the batch whose per-sample progress is "
                                                       "the unit (default: the minibatch)")
    p.add_argument("--staleness-costs", metavar="COSTS",
                   help="time-to-accuracy: also price the samples a plan's pipeline staleness, VW averaging and "
                        "WSP bound (--d) cost: none (default), fitted (fitted on hetpipe's convergence "
                        "benchmark) or PIPELINE,AVERAGING,WSP")
    p.add_argument("-o", "--output", help="write the plan as JSON to this file")


def _statistics(args) -> dict:
    """make_plan's ``noise_scale``, ``base_batch`` and ``staleness_costs`` from the command line;
    ArgumentError in one line."""
    from hetpipe.plan.time_to_accuracy import NEEDS_NOISE_SCALE
    from hetpipe.util.errors import ArgumentError

    if args.objective != "time-to-accuracy":
        for flag, value in (("--noise-scale", args.noise_scale), ("--base-batch", args.base_batch),
                            ("--staleness-costs", args.staleness_costs)):
            if value is not None:
                raise ArgumentError(f"{flag} is for --objective time-to-accuracy")
        return {}
    if args.noise_scale is None:
        raise ArgumentError(f"--objective time-to-accuracy needs --noise-scale B: {NEEDS_NOISE_SCALE}")
    out = {"noise_scale": number("--noise-scale", args.noise_scale)}
    if args.base_batch is not None:
        out["base_batch"] = number("--base-batch", args.base_batch, positive=True)
    if args.staleness_costs is not None:
        from hetpipe.plan.efficiency import staleness_costs

        try:
            out["staleness_costs"] = staleness_costs(args.staleness_costs)
        except ValueError as e:
            raise ArgumentError(f"--staleness-costs: {str(e).removeprefix('hetpipe: ')}") from None
    return out


def _run_plan(args) -> int:
    from hetpipe.plan import format_plan, make_plan
    from hetpipe.plan.cluster import load_cluster
    from hetpipe.util.outputs import OutputError, check_file, write_file

    try:
        for flag, path in (("-o", args.output), ("--save-cluster", args.save_cluster)):
            if path:
                check_file(flag, path)
    except OutputError as e:
        print(f"hetpipe plan: {e}", file=sys.stderr)
        return 2
    from pathlib import Path

    from hetpipe.plan.profile import profile_for_cluster

    ps_nodes = None
    try:
        statistics = _statistics(args)
        if args.cluster == "auto":
            discovery = _discover()
            if discovery is None:
                return 0            # not rank 0: rank 0 plans and reports
            cluster = discovery.cluster
            ps_nodes = [h.host for h in discovery.ps_slots()] or None
            print(discovery.table())
            args.save_cluster = args.save_cluster or "cluster.json"
        else:
            cluster = load_cluster(args.cluster)
        profile, note = profile_for_cluster(args.profile, cluster, precision=args.precision)
        if note:
            print(note)
        tf32 = args.precision == "tf32"
        plan = make_plan(cluster, profile, policy=args.policy, nm=args.nm, d=args.d,
                         num_ps_shards=args.ps_shards if ps_nodes is None else None, recompute=args.recompute,
                         precision="fp32" if tf32 else args.precision, ps_nodes=ps_nodes, tf32=tf32,
                         objective=args.objective, waves=args.waves, **statistics)
        plan = dataclasses.replace(plan, aggregate=args.aggregate, outer=args.outer, outer_lr=args.outer_lr,
                                   outer_momentum=args.outer_momentum, outer_staleness=args.outer_staleness,
                                   outer_gain=args.outer_gain, outer_delay=args.outer_delay)
        if args.save_cluster:
            write_file("--save-cluster", args.save_cluster, lambda p: Path(p).write_text(cluster.to_json() + "\n"))
            print(f"cluster: {args.save_cluster}")
    except (ValueError, OutputError) as e:
        print(f"hetpipe plan: {e}", file=sys.stderr)
        return 2
    print(format_plan(plan, cluster))
    if args.output:
        try:
            write_file("-o", args.output, plan.save)
        except OutputError as e:
            print(f"hetpipe plan: {e}", file=sys.stderr)
            return 2
        print(f"plan: {args.output}")
    return 0


def _discover():
    """Under mpiexec: every rank reports what it holds; rank 0 gets the discovery, the others None.
    A lone process describes the world ``hetpipe launch`` would start on this host
    (:func:`hetpipe.job.inventory.host_ranks`): its GPUs, or the ranks ``HETPIPE_EMULATE`` lists."""
    from hetpipe.job.discovery import discover
    from hetpipe.job.inventory import host_ranks, rank_facts
    from hetpipe.job.world import world

    comm = world()
    if comm.Get_size() == 1:
        n = host_ranks()
        facts = [rank_facts(r, n) for r in range(n)]
        if not any(f.get("emulate") or f.get("gpus") for f in facts) and not any(f["error"] for f in facts):
            raise ValueError("--cluster auto: this host shows no GPU (nvidia-smi) and HETPIPE_EMULATE is not set: "
                             "set it (e.g. HETPIPE_EMULATE=emu_fast,emu_slow), run under mpiexec on GPU hosts, or "
                             "give --cluster a preset or a cluster JSON file")
        return discover(facts)
    facts = comm.allgather(rank_facts(comm.Get_rank(), comm.Get_size()))
    try:
        found = discover(facts)     # the same on every rank: a bad world fails them all alike
    except ValueError:
        if comm.Get_rank() != 0:
            raise SystemExit(2) from None   # rank 0 says why, once
        raise
    return found if comm.Get_rank() == 0 else None


def _add_simulate_command(sub) -> None:
    p = sub.add_parser("simulate", help="simulate a plan's schedules under WSP; print per-stage utilisation")
    p.add_argument("--plan", required=True, help="plan JSON file (hetpipe plan writes one)")
    p.add_argument("--waves", default="10", help="waves per virtual worker (default 10)")
    p.add_argument("--cluster", help="cluster preset or JSON file of the plan, for the PS model "
                                     "(default: the plan's cluster, if it is a preset)")
    p.add_argument("--profile", help="model profile preset or JSON file of the plan, for the PS model "
                                     "(default: the plan's profile, if it is a preset)")
    p.add_argument("--ps-apply-rate", default=None,
                   help="bytes/s a PS shard applies pushed deltas at (default 4e9; bench/core_apply.py measures it)")
    from hetpipe.schedule.registry import schedule_names

    p.add_argument("--schedule", choices=schedule_names(), default="hetpipe",
                   help="the registered schedule every VW runs (default hetpipe); one that does not take the "
                        "plan's Nm or D refuses them")
    p.add_argument("--push", default="0", help="extra fixed seconds per stage and wave to push to the PS")
    p.add_argument("--pull", default="0", help="extra fixed seconds per stage and wave to pull the global weights")
    p.add_argument("--trace", help="write the timeline as Chrome trace JSON to this file")
    p.add_argument("--png", help="write a Gantt chart PNG to this file (needs matplotlib)")


def _ps_model(args, plan):
    """``(cluster, param_bytes)`` for the PS model, from the flags or the plan's presets; None if neither."""
    from hetpipe.plan.cluster import load_cluster, presets
    from hetpipe.plan.profile import load_profile

    cluster_name = args.cluster or plan.meta.get("cluster")
    profile_name = args.profile or plan.meta.get("profile")
    if args.cluster is None and cluster_name not in presets():
        return None
    if not profile_name:
        return None
    try:
        profile = load_profile(profile_name)
    except ValueError:
        if args.profile:
            raise
        return None
    return load_cluster(cluster_name), [float(layer.param_bytes) for layer in profile.layers]


def _run_simulate(args) -> int:
    from hetpipe.plan.types import Plan
    from hetpipe.schedule import save_gantt, simulate_plan
    from hetpipe.schedule.ps import DEFAULT_APPLY_RATE
    from hetpipe.schedule.simulate import check_waves
    from hetpipe.schedule.trace import write_chrome_trace
    from hetpipe.util.outputs import OutputError, check_file, write_file

    try:
        for flag, path in (("--trace", args.trace), ("--png", args.png)):
            if path:
                check_file(flag, path)
        waves = number("--waves", args.waves, integer=True, positive=True)
        push, pull = number("--push", args.push), number("--pull", args.pull)
        rate = DEFAULT_APPLY_RATE if args.ps_apply_rate is None else number(
            "--ps-apply-rate", args.ps_apply_rate, positive=True)
        plan = Plan.load(args.plan)
        check_waves(plan, waves, "--waves")
        ps = _ps_model(args, plan)
        result = simulate_plan(plan, waves=waves, push=push, pull=pull, apply_rate=rate,
                               cluster=None if ps is None else ps[0], param_bytes=None if ps is None else ps[1],
                               schedule=args.schedule)
    except (ValueError, OutputError) as e:
        print(f"hetpipe simulate: {e}", file=sys.stderr)
        return 2
    print(result.table())
    if ps is None:
        print("PS shards: not modelled (they serve at once); pass --cluster and --profile to model them")
    else:
        print(f"PS shards: modelled as resources (apply {rate:g} B/s)")
    if plan.throughput:
        print(f"planner cost model: {plan.throughput:.3f} minibatches/s")
    try:
        if args.trace:
            write_file("--trace", args.trace, lambda p: write_chrome_trace(result.timeline, p))
            print(f"trace: {args.trace}")
        if args.png:
            write_file("--png", args.png, lambda p: save_gantt(result, p))
            print(f"gantt: {args.png}")
    except (RuntimeError, OutputError) as e:
        print(f"hetpipe simulate: {e}", file=sys.stderr)
        return 2
    return 0


def _add_launch_command(sub) -> None:
    p = sub.add_parser("launch", help="run a training script on N MPI ranks (mpiexec from this environment)")
    p.add_argument("-n", "--np", dest="n", type=arg_whole("-n"), help="number of ranks (default: the --plan's)")
    p.add_argument("--hostfile", help="hosts to run on, one per line: host, host:slots or host slots=N; ranks fill "
                                      "the slots in order (default: -H, else the Slurm allocation, else this host)")
    p.add_argument("-H", "--hosts", dest="hosts", metavar="HOST:SLOTS,...", help="hosts to run on, as host:slots,...")
    p.add_argument("--plan", metavar="PLAN",
                   help="train this plan (the script's plan= must be none or the same); put each rank on the host "
                        "its node names; each node of the plan must be a host of the list")
    p.add_argument("--cluster", metavar="SPEC", help="the cluster a script's Trainer plans on when it names none: "
                                                     "auto (discover the ranks' devices), a preset or a JSON file "
                                                     "(the script's planning.cluster must be unset or the same)")
    p.add_argument("--emulate-hosts", action="store_true",
                   help="run every rank on this machine, each counting as the host the list gives it (HETPIPE_HOST): "
                        "multi-node placement and supervision tested on one machine")
    p.add_argument("--mpi-arg", action="append", default=[], metavar="ARG",
                   help="pass ARG to mpiexec as it is (repeat for several, e.g. --mpi-arg=-genv --mpi-arg=X --mpi-arg=1)")
    p.add_argument("--timeout", type=arg_seconds("--timeout"),
                   help="seconds a rank may wait for a peer (runtime.timeout); a rank stopped for half of it is "
                        "declared unresponsive")
    p.add_argument("--start-timeout", type=arg_seconds("--start-timeout"), metavar="SECONDS",
                   help="seconds every rank gets to reach MPI start-up before the launcher names the ones that did "
                        "not and ends the job (sets HETPIPE_START_TIMEOUT; default: the peer timeout, at least 60)")
    p.add_argument("--term-grace", type=arg_seconds("--term-grace", inclusive=True), metavar="SECONDS",
                   help="when the launcher is interrupted (SIGINT/SIGTERM/SIGHUP), how long the ranks get to write "
                        "their SIGTERM checkpoint and exit before SIGKILL (sets HETPIPE_TERM_GRACE; default 60)")
    p.add_argument("--run-dir", help="directory for the ranks' pids and the run's outcome.json (default: a "
                                     "temporary one, kept only if the run fails)")
    p.add_argument("--checkpoint-dir", help="checkpoint every --checkpoint-every waves into this directory (for a "
                                            "script whose Trainer sets no checkpointing.dir)")
    p.add_argument("--checkpoint-every", type=arg_whole("--checkpoint-every"), help="waves between checkpoints (default 1)")
    p.add_argument("--resume", metavar="DIR", help="resume from the latest complete checkpoint in DIR")
    p.add_argument("--max-restarts", type=arg_whole("--max-restarts", 0), default=0,
                   help="after a rank dies or stops answering, restart the job up to this many times without "
                        "its device, from the latest checkpoint (attempt k runs in RUN_DIR/attempt-k); also after "
                        "a checkpoint write found its disk full, with the same devices")
    p.add_argument("--exclude-device", action="append", default=[], metavar="ID",
                   help="mark a device of the plan failed: resume (--resume) without the VW holding it")
    p.add_argument("--plan-cache", metavar="DIR", help="reuse the plan, profile and cluster kept in DIR when the "
                                                      "model, cluster and settings match, else plan and keep them "
                                                      "there (planning.plan_cache)")
    p.add_argument("--transport", help="the stage ranks' transport backend, e.g. torch-p2p or mpi-host "
                                       "(runtime.transport; default: chosen per pair of stages, reported in the "
                                       "metrics)")
    p.add_argument("script", help="the Python script every rank runs")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the script")


def _run_launch(args) -> int:
    import os
    from pathlib import Path

    from hetpipe.checkpoint.format import CheckpointError
    from hetpipe.job.launch_file import LaunchSettings
    from hetpipe.job.world import MPIUnavailable
    from hetpipe.launch.checks import check_arguments
    from hetpipe.launch.mpiexec import launch

    if args.transport is not None:
        from hetpipe.transport.registry import names

        if args.transport not in names():
            print(f"hetpipe launch: --transport must be one of {', '.join(names())}, got {args.transport!r}",
                  file=sys.stderr)
            return 2
    if args.term_grace is not None:
        os.environ["HETPIPE_TERM_GRACE"] = str(args.term_grace)
    if args.start_timeout is not None:
        os.environ["HETPIPE_START_TIMEOUT"] = str(args.start_timeout)

    def absolute(path):
        return str(Path(path).resolve()) if path is not None else None

    try:
        placement = _placement(args)
        check_arguments(args, args.n, placement)        # before anything is made or started
        # The ranks' run file (hetpipe.job.launch_file): what this launch asks of the script's Trainer.
        settings = LaunchSettings(cluster=args.cluster, plan_cache=absolute(args.plan_cache), plan=absolute(args.plan),
                                  plan_reason="hetpipe launch --plan" if args.plan else None,
                                  checkpoint_dir=absolute(args.checkpoint_dir), checkpoint_every=args.checkpoint_every,
                                  resume=absolute(args.resume), transport=args.transport, timeout=args.timeout)
        if args.max_restarts or args.resume or args.checkpoint_dir or args.exclude_device or \
                args.checkpoint_every is not None:
            from hetpipe.launch.restart import launch_with_restarts

            if args.max_restarts < 0:
                raise ValueError(f"hetpipe launch: --max-restarts must be >= 0, got {args.max_restarts}")
            return launch_with_restarts(args.n, [args.script, *args.args], run_dir=args.run_dir,
                                        max_restarts=args.max_restarts, settings=settings,
                                        exclude=args.exclude_device, placement=placement, mpi_args=args.mpi_arg)
        return launch(args.n, [args.script, *args.args], run_dir=args.run_dir, placement=placement,
                      mpi_args=args.mpi_arg, settings=settings)
    except (MPIUnavailable, ValueError, CheckpointError, OSError) as e:
        # One line, in the command line's own words: "hetpipe launch: <what>" (a message that names
        # hetpipe already keeps its own prefix off, so that it is not said twice).
        text = str(e).removeprefix("hetpipe launch: ").removeprefix("hetpipe: ")
        print(f"hetpipe launch: {text}", file=sys.stderr)
        return 2


def _placement(args):
    """The launch's :class:`~hetpipe.launch.hosts.Placement` (None: every rank on this host); sets
    ``args.n`` from ``--plan`` when not given."""

    from hetpipe.job.placement import node_of
    from hetpipe.launch.hosts import HostsError, Placement, choose
    from hetpipe.plan.types import Plan

    slots = choose(args.hostfile, args.hosts)
    nodes = None
    if args.plan is not None:
        if args.max_restarts:
            raise ValueError("hetpipe launch: --plan places the ranks of one plan; --max-restarts re-plans, so "
                             "they do not go together (use a plan cache instead)")
        try:
            plan = Plan.load(args.plan)
        except ValueError as e:
            raise ValueError(f"hetpipe launch: --plan {args.plan}: {e}") from None
        args.n = args.n or plan.num_ranks
        if args.n != plan.num_ranks:
            raise ValueError(f"hetpipe launch: the plan {args.plan} needs {plan.num_ranks} ranks, -n is {args.n}")
        nodes = tuple(node_of(plan, r) for r in range(plan.num_ranks))
        if slots is not None and None in nodes:
            r = nodes.index(None)
            raise HostsError(f"hetpipe launch: rank {r} of the plan {args.plan} runs on a bare device "
                             f"({plan.role_of(r)}), which names no node to put it on")
    if args.n is None:
        raise ValueError("hetpipe launch: give -n (the number of ranks) or --plan")
    if args.emulate_hosts and slots is None:
        raise ValueError("hetpipe launch: --emulate-hosts needs the hosts (--hostfile or -H)")
    if slots is None:
        return None
    placement = Placement(slots, bool(args.emulate_hosts), nodes)
    placement.rank_hosts(args.n)        # too few slots, or a node not listed: said now, before anything starts
    return placement


def _add_export_command(sub) -> None:
    p = sub.add_parser("export", help="a checkpoint's weights under the model's own names (safetensors, or a "
                                      "Hugging Face folder)")
    p.add_argument("checkpoint", help="a checkpoint directory (its latest complete checkpoint) or one clock of it")
    p.add_argument("-o", "--output", help="write a .safetensors file that model.load_state_dict takes")
    p.add_argument("--hf", metavar="DIR", help="write a folder from_pretrained opens (model.safetensors, config.json)")


def _run_export(args) -> int:
    from pathlib import Path

    from hetpipe.checkpoint.export import export
    from hetpipe.checkpoint.format import CheckpointError

    try:
        print(export(Path(args.checkpoint), Path(args.output) if args.output else None,
                     Path(args.hf) if args.hf else None))
    except (CheckpointError, OSError) as e:
        print(f"hetpipe export: {e}" if not str(e).startswith("hetpipe") else str(e), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
