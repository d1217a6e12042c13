"""Running a benchmark's command line in a test."""

import argparse

import pytest


@pytest.fixture
def bench(capsys):
    """bench(module, *argv) parses argv with the module's own flags, runs its main (which
    must return 0) and returns what it printed."""

    def run(module, *argv: str) -> str:
        p = argparse.ArgumentParser()
        module.add_args(p)
        assert module.main(p.parse_args(list(argv))) == 0
        return capsys.readouterr().out

    return run
