"""The `syncless` command (and `python -m syncless`): the doctor on a script, or the demo."""
from __future__ import annotations

import argparse
import sys
from typing import Callable

from . import __version__, demo
from .doctor import cli as doctor_cli

DOCTOR_HELP = ("run a training script through warm-up, monitor, probe (CUDA), audit and trace "
               "phases at its optimizer steps, stop it, and print where a step's time goes, "
               "with the fixes")
DEMO_HELP = ("train a small MLP logged with .item() and with syncless.Logger; print syncs per "
             "step, step time, and whether the logged values are identical")


def build_parser(prog: str = "syncless") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Sync-free metric logging, GPU timing and sync diagnosis for "
                               "PyTorch training loops.",
        epilog=f"`{prog} <command> --help` says more about each command.")
    parser.add_argument("--version", action="version", version=f"syncless {__version__}")
    commands = parser.add_subparsers(title="commands", dest="command", metavar="<command>",
                                     required=True)
    doctor = commands.add_parser(
        "doctor", help=DOCTOR_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
        description=doctor_cli.__doc__.split("\n\n", 1)[1])   # less its first line: the usage
    doctor_cli.add_arguments(doctor)
    doctor.set_defaults(run=lambda ns: doctor_cli.run(doctor_cli.checked(doctor, ns)))
    demo_parser = commands.add_parser("demo", help=DEMO_HELP, description=demo.DESCRIPTION)
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(run=demo.run)
    return parser


def main(argv: list[str] | None = None, prog: str = "syncless") -> int:
    """The console script's entry point: the exit code (argparse exits 2 on bad usage)."""
    parser = build_parser(prog)
    if not (sys.argv[1:] if argv is None else argv):
        parser.print_help(sys.stderr)         # a newcomer's first try: the commands, not an error
        return 2
    ns = parser.parse_args(argv)
    ns.from_start = argv is None              # the command line's: its clock is the user's
    run: Callable[[argparse.Namespace], int] = ns.run
    return run(ns)


if __name__ == "__main__":
    sys.exit(main(prog="python -m syncless"))
