"""Test-suite root.

This file makes ``tests/`` importable (pytest puts the folder of a rootdir conftest on
``sys.path``), so any test can ``from helpers import make_tiny_model, ...``, and reports the
CPU and the execution paths a run tested (in the header, and in a closing section that ``-q``
keeps): the compiled kernels may be on, off (``PAGELLM_CPU_KERNELS=0``, no compiler, a failed
build) or built for another ISA level (``PAGELLM_CPU_ISA``), and a CI log must say which.

The property tests (hypothesis: the scheduler and KV-manager state machines, sampling,
stop strings) draw the same examples on every run by default (profile "suite":
derandomized, no example database), so that the suite passes or fails the same way on every
run of one commit. ``--hypothesis-profile=explore`` draws new examples on each run, to look
for new failures (``pytest tests -k "machine or extremes or stop_strings"
--hypothesis-profile=explore``, as many runs as there is time for); a failure prints the
example to turn into a regression test.
"""
from __future__ import annotations

try:
    from hypothesis import settings
except ImportError:  # the property tests skip without it
    pass
else:
    settings.register_profile("suite", derandomize=True, database=None)
    settings.register_profile("explore", derandomize=False, database=None)
    settings.load_profile("suite")


def _paths() -> list[str]:
    import torch

    from pagellm.worker.execution_paths import describe_paths

    lines = [f"torch {torch.__version__}"]
    return lines + [f"pagellm {name}: {path}" for name, path in describe_paths().items()]


def pytest_report_header(config) -> list[str]:
    return _paths()


def pytest_terminal_summary(terminalreporter) -> None:
    terminalreporter.section("execution paths tested")
    for line in _paths():
        terminalreporter.write_line(line)
