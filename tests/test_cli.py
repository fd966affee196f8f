"""The `syncless` command (the console script) and `python -m syncless`: the subcommands, their
help, their errors on bad input, and the demo run end to end."""
import json
import os
import subprocess
import sys

import pytest

from syncless import __main__ as cli
from syncless import __version__


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")         # argparse wraps help to the terminal's width


def flat(text):
    """Help text with its wrapping undone (argparse wraps to the terminal's width)."""
    return " ".join(text.split())


def run(argv, capsys, prog="syncless"):
    """(exit code, stdout, stderr) of the command line, in this process."""
    try:
        code = cli.main(argv, prog=prog)
    except SystemExit as e:                      # argparse: --help, --version, usage errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_the_commands_with_what_they_do(flag, capsys):
    code, out, err = run([flag], capsys)
    assert code == 0 and err == ""
    assert out.startswith("usage: syncless [-h] [--version] <command> ...\n")
    text = flat(out)
    assert " doctor run a training script through warm-up, monitor, probe (CUDA), audit" in text
    assert " demo train a small MLP logged with .item() and with syncless.Logger" in text
    assert "`syncless <command> --help` says more about each command." in out


def test_no_command_prints_the_help_and_exits_2(capsys):
    code, out, err = run([], capsys)
    assert code == 2 and out == ""
    assert err.startswith("usage: syncless [-h] [--version] <command> ...")
    assert " doctor run a training script" in flat(err) and " demo train a small" in flat(err)


def test_an_unknown_command_names_the_choices(capsys):
    code, out, err = run(["doctr"], capsys)
    assert code == 2
    assert "syncless: error: argument <command>: invalid choice: 'doctr' (choose from " \
           "'doctor', 'demo')" in err


def test_version(capsys):
    code, out, _ = run(["--version"], capsys)
    assert code == 0 and out == f"syncless {__version__}\n"


def test_doctor_without_a_script_asks_for_the_script_only(capsys):
    code, out, err = run(["doctor"], capsys)
    assert code == 2
    assert err.endswith("syncless doctor: error: the following arguments are required: script\n")
    assert "args" not in err.splitlines()[-1]


def test_doctor_help_names_the_command_and_its_options(capsys):
    code, out, err = run(["doctor", "--help"], capsys)
    assert code == 0 and err == ""
    assert out.startswith("usage: syncless doctor [-h] [--warmup N] [--steps N]")
    assert "python -m syncless doctor" not in out
    assert "A step ends at the strongest boundary the script shows" in out
    for option in ("--warmup N", "--steps N", "--audit-steps N", "--trace PATH", "--quick",
                   "--json PATH", "--step-at FILE:LINE"):
        assert f"\n  {option}" in out, option
    assert "the script's own arguments" in out


def test_doctor_checks_its_input_before_the_script_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("raise SystemExit('must not run')\n")
    code, _, err = run(["doctor", "no_such_script.py"], capsys)
    assert code == 2 and err.endswith("syncless doctor: error: script not found: "
                                      "no_such_script.py\n")
    code, _, err = run(["doctor", "--steps", "0", "x.py"], capsys)
    assert code == 2 and "syncless doctor: error: argument --steps: must be at least 1, got 0" \
        in err
    code, _, err = run(["doctor", "--json", "no_such_folder/d.json", "x.py"], capsys)
    assert code == 2 and "syncless doctor: error: --json: folder " in err


def test_demo_help_names_the_command_and_explains_each_option(capsys):
    code, out, err = run(["demo", "--help"], capsys)
    assert code == 0 and err == ""
    assert out.startswith("usage: syncless demo [-h] [--steps N] [--device D] [--out DIR]\n")
    assert "python -m syncless.demo" not in out
    text = flat(out)
    assert "--steps N training steps of each run (default: 300 with a GPU, 100 without)" in text
    assert "--device D where the model trains: cpu, cuda or cuda:N (default: " in text
    assert "--out DIR folder for demo-naive.jsonl and demo-syncless.jsonl, created if missing " \
           "(default: runs)" in text


@pytest.mark.parametrize("argv, error", [
    (["--steps", "0"], "argument --steps: must be at least 1, got 0"),
    (["--steps", "ten"], "argument --steps: expected a whole number, got 'ten'"),
    (["--device", "gpu0"], "argument --device: not a torch device: 'gpu0'"),
    (["--device", "meta"], "argument --device: the demo runs on cpu or cuda, got 'meta'"),
])
def test_demo_rejects_bad_input(argv, error, capsys):
    code, _, err = run(["demo", *argv], capsys)
    assert code == 2 and f"syncless demo: error: {error}" in err, err


def test_demo_logs_the_same_values_both_ways(tmp_path, capsys):
    code, out, err = run(["demo", "--steps", "3", "--device", "cpu", "--out",
                          str(tmp_path / "runs")], capsys)
    assert code == 0, out + err
    assert "syncless demo: 3 steps of a 3-layer MLP on cpu" in out
    assert "logged values identical: yes (3 steps x 4 metrics)" in out
    for name in ("naive", "syncless"):
        rows = [json.loads(line) for line in
                (tmp_path / "runs" / f"demo-{name}.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [0, 1, 2]
        assert {"step", "loss", "accuracy", "confidence", "grad_norm"} <= set(rows[0])


def test_python_dash_m_syncless_is_the_same_command():
    r = subprocess.run([sys.executable, "-m", "syncless", "doctor"], capture_output=True,
                       text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("usage: python -m syncless doctor [-h]")
    assert r.stderr.endswith("python -m syncless doctor: error: the following arguments are "
                             "required: script\n")
