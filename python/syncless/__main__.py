"""python -m syncless doctor script.py [args] (the doctor on a script), python -m syncless demo."""
import sys


def main(argv: list[str]) -> int:
    if argv[:1] == ["demo"]:
        from .demo import main as demo_main
        return demo_main(argv[1:])
    if argv[:1] != ["doctor"]:
        print("usage: python -m syncless doctor [--steps N] [--warmup N] script.py [args...]\n"
              "       python -m syncless demo [--steps N]", file=sys.stderr)
        return 2
    from .doctor.cli import main as doctor_main
    return doctor_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
