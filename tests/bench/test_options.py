"""The benchmarks' option types: parsed values, and bad ones as one-line usage errors
before anything loads."""

import argparse

import pytest

from tokendance.bench.options import batches, counts, natural, nonnegative, positive, share, shares
from tokendance.examples import cli


def test_values():
    assert counts("10,20") == [10, 20]
    assert shares("0.15,0,1") == [0.15, 0.0, 1.0]
    assert batches("1x1024,8x256") == [(1, 1024), (8, 256)]
    assert batches("") == []
    assert positive("3") == 3 and natural("0") == 0
    assert share("0.045") == 0.045 and share("1") == 1.0 and nonnegative("0.3") == 0.3


@pytest.mark.parametrize("parse,text", [(counts, "x"), (counts, "2,0"), (counts, ""), (counts, "3,,4"),
                                        (shares, "0.1,1.5"), (shares, "a"), (batches, "10"),
                                        (batches, "2x0"), (batches, "1x2x3"), (batches, "ax4"),
                                        (positive, "0"), (positive, "1.5"), (natural, "-1"),
                                        (share, "1.5"), (share, "nan"), (share, "x"),
                                        (nonnegative, "-0.1"), (nonnegative, "nan")])
def test_bad_values(parse, text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse(text)


@pytest.mark.parametrize("argv,message", [
    (["reuse", "--agents", "x"], "argument --agents: expected integers separated by commas, got 'x'"),
    (["restore", "--agents", "0"], "argument --agents: every count must be at least 1"),
    (["restore", "--ratio", "0.2,2"], "argument --ratio: every share must lie in [0, 1]"),
    (["engine", "--prefill", "10"], "argument --prefill: expected BATCHxLEN pairs"),
    (["mirror-decode", "--agents", "-1"], "argument --agents"),
    (["mirror-decode", "--steps", "0"], "argument --steps: must be at least 1, got 0"),
    (["reuse", "--history", "-5"], "argument --history: must be at least 0, got -5"),
    (["resume", "--repeats", "x"], "argument --repeats: expected an integer, got 'x'"),
    (["reuse", "--ratio", "1.5"], "argument --ratio: must lie in [0, 1], got '1.5'"),
    (["fidelity", "--floor", "-1"], "argument --floor: must be at least 0, got '-1'"),
    (["memory", "--requests", "0"], "argument --requests: must be at least 1, got 0"),
    (["memory", "--kv-tokens", "-5"], "argument --kv-tokens: must be at least 1, got -5"),
])
def test_bad_lists_are_one_line_usage_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_every_benchmark_loads_without_the_openai_sdk():
    """`tokendance bench` imports every benchmark to build its parser: on the GPU host,
    which has no openai package, `bench engine` must still start."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['openai'] = None; from tokendance.examples import cli; "
            "sys.exit(cli.main(['bench', 'engine', '--help']))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "--prefill" in res.stdout, res.stderr[-1000:]
