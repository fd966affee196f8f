"""python -m syncless <command> [args...]: the doctor on a script, or the demo."""
from __future__ import annotations

import sys

USAGE = """\
usage: python -m syncless <command> [args...]

commands:
  doctor [options] script.py [args...]
           run a training script through warm-up, monitor, probe (CUDA), audit and trace
           phases at its optimizer steps, stop it, and print where a step's time goes, with
           the fixes
  demo [--steps N] [--device D] [--out DIR]
           train a small MLP logged with .item() and with syncless.Logger; print syncs per
           step, step time, and whether the logged values are identical

python -m syncless <command> --help says more about each command."""


def main(argv: list[str]) -> int:
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    if command in ("-h", "--help"):
        print(USAGE)
        return 0
    if command == "--version":
        from . import __version__
        print(f"syncless {__version__}")
        return 0
    if command == "demo":
        from .demo import main as demo_main
        return demo_main(rest)
    if command == "doctor":
        from .doctor.cli import main as doctor_main
        return doctor_main(rest)
    print(f"python -m syncless: unknown command {command!r} (choose doctor or demo)\n\n{USAGE}",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
