"""Command line: `hetpipe plan | simulate | demo | launch`."""

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="hetpipe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="what the compiled core contains")
    _add_plan_command(sub)
    _add_simulate_command(sub)
    _add_demo_command(sub)
    _add_launch_command(sub)
    args = parser.parse_args(argv)
    if args.command == "plan":
        return _run_plan(args)
    if args.command == "simulate":
        return _run_simulate(args)
    if args.command == "demo":
        return _run_demo(args)
    if args.command == "launch":
        return _run_launch(args)
    if args.command == "info":
        import hetpipe_core
        print(hetpipe_core.build_info())
    return 0


def _add_plan_command(sub) -> None:
    p = sub.add_parser("plan", help="plan VWs, stages, Nm and PS shards for a model on a cluster")
    p.add_argument("--cluster", required=True, help="cluster preset name or JSON file")
    p.add_argument("--profile", required=True, help="model profile preset name or JSON file")
    p.add_argument("--policy", default="auto", help="VW formation: NP, ED, HD or auto (default)")
    p.add_argument("--nm", type=int, help="minibatches in flight per VW (default: chosen by the planner)")
    p.add_argument("--d", type=int, default=0, help="WSP staleness bound D (default 0)")
    p.add_argument("--recompute", choices=("none", "fit", "all"), default="none",
                   help="recompute activations: never, only to fit memory, or on every stage")
    p.add_argument("--ps-shards", type=int, help="number of parameter-server shards (default: one per node)")
    p.add_argument("-o", "--output", help="write the plan as JSON to this file")


def _run_plan(args) -> int:
    from hetpipe.cluster import load_cluster
    from hetpipe.plan import format_plan, make_plan

    try:
        cluster = load_cluster(args.cluster)
        plan = make_plan(cluster, args.profile, policy=args.policy, nm=args.nm, d=args.d,
                         num_ps_shards=args.ps_shards, recompute=args.recompute)
    except ValueError as e:
        print(f"hetpipe plan: {e}", file=sys.stderr)
        return 2
    print(format_plan(plan, cluster))
    if args.output:
        plan.save(args.output)
        print(f"plan: {args.output}")
    return 0


def _add_simulate_command(sub) -> None:
    p = sub.add_parser("simulate", help="simulate a plan's schedules under WSP; print per-stage utilisation")
    p.add_argument("--plan", required=True, help="plan JSON file (hetpipe plan writes one)")
    p.add_argument("--waves", type=int, default=10, help="waves per virtual worker (default 10)")
    p.add_argument("--push", type=float, default=0.0, help="seconds per stage to push one wave to the PS")
    p.add_argument("--pull", type=float, default=0.0, help="seconds per stage to pull the global weights")
    p.add_argument("--trace", help="write the timeline as Chrome trace JSON to this file")
    p.add_argument("--png", help="write a Gantt chart PNG to this file (needs matplotlib)")


def _run_simulate(args) -> int:
    from hetpipe.plan.types import Plan
    from hetpipe.schedule import save_gantt, simulate_plan
    from hetpipe.schedule.trace import write_chrome_trace

    try:
        plan = Plan.load(args.plan)
        result = simulate_plan(plan, waves=args.waves, push=args.push, pull=args.pull)
    except ValueError as e:
        print(f"hetpipe simulate: {e}", file=sys.stderr)
        return 2
    print(result.table())
    if plan.throughput:
        print(f"planner cost model: {plan.throughput:.3f} minibatches/s")
    if args.trace:
        write_chrome_trace(result.timeline, args.trace)
        print(f"trace: {args.trace}")
    if args.png:
        try:
            save_gantt(result, args.png)
        except RuntimeError as e:
            print(f"hetpipe simulate: {e}", file=sys.stderr)
            return 2
        print(f"gantt: {args.png}")
    return 0


def _add_launch_command(sub) -> None:
    p = sub.add_parser("launch", help="run a training script on N MPI ranks (mpiexec from this environment)")
    p.add_argument("-n", "--np", dest="n", type=int, required=True, help="number of ranks")
    p.add_argument("--timeout", type=float, help="seconds a rank may wait for a peer (sets HETPIPE_TIMEOUT); "
                                                 "a rank stopped for half of it is declared unresponsive")
    p.add_argument("--run-dir", help="directory for the ranks' pids and the run's outcome.json (default: a "
                                     "temporary one, kept only if the run fails)")
    p.add_argument("--checkpoint-dir", help="checkpoint every --checkpoint-every waves into this directory (for a "
                                            "script whose Trainer sets no checkpoint_dir)")
    p.add_argument("--checkpoint-every", type=int, help="waves between checkpoints (default 1)")
    p.add_argument("--resume", metavar="DIR", help="resume from the latest complete checkpoint in DIR")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="after a rank dies or stops answering, restart the job up to this many times without "
                        "its device, from the latest checkpoint (attempt k runs in RUN_DIR/attempt-k)")
    p.add_argument("--exclude-device", action="append", default=[], metavar="ID",
                   help="mark a device of the plan failed: resume (--resume) without the VW holding it")
    p.add_argument("script", help="the Python script every rank runs")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the script")


def _run_launch(args) -> int:
    import os

    from hetpipe.launch.mpi import MPIUnavailable, launch
    from hetpipe.runtime.checkpoint import CheckpointError

    if args.timeout is not None:
        os.environ["HETPIPE_TIMEOUT"] = str(args.timeout)
    try:
        if args.max_restarts or args.resume or args.checkpoint_dir or args.exclude_device or \
                args.checkpoint_every is not None:
            from hetpipe.launch.restart import launch_with_restarts

            if args.max_restarts < 0:
                raise ValueError(f"hetpipe launch: --max-restarts must be >= 0, got {args.max_restarts}")
            return launch_with_restarts(args.n, [args.script, *args.args], run_dir=args.run_dir,
                                        max_restarts=args.max_restarts, resume=args.resume,
                                        checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                                        exclude=args.exclude_device)
        return launch(args.n, [args.script, *args.args], run_dir=args.run_dir)
    except (MPIUnavailable, ValueError, CheckpointError) as e:
        print(e, file=sys.stderr)
        return 2


def _add_demo_command(sub) -> None:
    p = sub.add_parser("demo", help="plan and train on an emulated heterogeneous cluster on this machine")
    p.add_argument("--out", default="hetpipe-demo-out", help="output directory (default ./hetpipe-demo-out)")
    p.add_argument("--epochs", type=int, default=12, help="training epochs (default 12)")
    p.add_argument("--cluster", default="cpu-emulated", help="cluster preset to plan for (default cpu-emulated)")
    p.add_argument("--policy", default="auto", help="VW formation policy (default auto)")
    p.add_argument("--nm", type=int, default=2, help="minibatches in flight per VW (default 2)")
    p.add_argument("--d", type=int, default=1, help="WSP staleness bound D (default 1)")
    p.add_argument("--batch", type=int, default=32, help="minibatch size (default 32)")
    p.add_argument("--plan", help="use this plan JSON instead of planning")
    p.add_argument("--slowdown", type=float, default=12.0,
                   help="plan for emulated devices this many times slower than the preset, so that device "
                        "time dominates host overheads (default 12)")
    p.add_argument("--emulation-scale", type=float, default=1.0,
                   help="multiply emulated device times at run time only (the plan's predictions do not follow)")
    p.add_argument("--min-accuracy", type=float, default=0.9, help="fail below this test accuracy")


def _run_demo(args) -> int:
    from pathlib import Path

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan_path = out / "plan.json"
    try:
        plan = _demo_plan(args)
    except (ImportError, ValueError) as e:
        print(f"hetpipe demo: planning failed: {e}", file=sys.stderr)
        return 2
    plan.save(plan_path)
    from hetpipe.launch.mpi import MPIUnavailable, launch

    print(f"launching {plan.num_ranks} ranks ({plan.num_stage_ranks} stages, {len(plan.ps_shards)} PS shard(s))")
    try:
        rc = launch(plan.num_ranks, ["-m", "hetpipe.runtime.demo", "--plan", str(plan_path), "--out", str(out),
                                     "--epochs", str(args.epochs), "--batch", str(args.batch),
                                     "--emulation-scale", str(args.emulation_scale),
                                     "--min-accuracy", str(args.min_accuracy)])
    except MPIUnavailable as e:
        print(e, file=sys.stderr)
        return 2
    if rc == 0:
        print(f"metrics: {out / 'metrics.jsonl'}  trace: {out / 'trace.json'}  plan: {plan_path}")
    else:
        print(f"hetpipe demo: the run failed (exit status {rc})", file=sys.stderr)
    return rc


def _demo_plan(args):
    """Profile the digits model on the cluster preset, plan it, print the plan table."""
    from hetpipe.plan.types import Plan

    if args.plan:
        plan = Plan.load(args.plan)
    else:
        import torch

        from hetpipe.cluster import load_cluster
        from hetpipe.plan import make_plan
        from hetpipe.profile import profile_model
        from hetpipe.runtime.data import digits
        from hetpipe.runtime.demo import digits_model, loss_fn, slowed

        torch.set_num_threads(1)
        cluster = slowed(load_cluster(args.cluster), args.slowdown)
        x, y, _, _ = digits()
        sample = x[:args.batch]
        profile = profile_model(digits_model(), sample, cluster, loss_fn=lambda out: loss_fn(out, y[:args.batch]))
        plan = make_plan(cluster, profile, policy=args.policy, nm=args.nm, d=args.d, minibatch_size=args.batch)
    try:
        from hetpipe.plan import format_plan
        print(format_plan(plan))
    except ImportError:
        print(plan.to_json())
    return plan


if __name__ == "__main__":
    sys.exit(main())
