"""python -m syncless doctor [options] script.py [args] (the doctor on a script: warm-up, monitor,
probe, audit and trace phases at its optimizer steps), python -m syncless demo."""
import sys


def main(argv: list[str]) -> int:
    if argv[:1] == ["demo"]:
        from .demo import main as demo_main
        return demo_main(argv[1:])
    if argv[:1] != ["doctor"]:
        print("usage: python -m syncless doctor [--warmup N] [--steps N] [--probe-steps N] "
              "[--audit-steps N]\n"
              "                                 [--trace PATH [--trace-steps N]] script.py "
              "[args...]\n"
              "       python -m syncless demo [--steps N]\n"
              "The doctor runs the script through its phases (warm-up, monitor, probe on CUDA, "
              "audit, trace\nwith --trace) at its optimizer steps, stops it and prints where a "
              "step's time goes, with the\nfixes; python -m syncless doctor --help says more.",
              file=sys.stderr)
        return 2
    from .doctor.cli import main as doctor_main
    return doctor_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
