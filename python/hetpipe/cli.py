"""Command line: `hetpipe plan | simulate | demo | launch`."""

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="hetpipe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="what the compiled core contains")
    _add_simulate_command(sub)
    args = parser.parse_args(argv)
    if args.command == "simulate":
        return _run_simulate(args)
    if args.command == "info":
        import hetpipe_core
        print(hetpipe_core.build_info())
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


if __name__ == "__main__":
    sys.exit(main())
