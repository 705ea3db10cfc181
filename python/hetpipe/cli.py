"""Command line: `hetpipe plan | simulate | demo | launch`."""

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="hetpipe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="what the compiled core contains")
    args = parser.parse_args(argv)
    if args.command == "info":
        import hetpipe_core
        print(hetpipe_core.build_info())
    return 0


if __name__ == "__main__":
    sys.exit(main())
