"""The test suite's time and memory budget, measured on every run and enforced where asked.

Why a plugin of our own: pytest's ``--durations`` reports time but not memory, and nothing in
pytest fails a run for either. We need both per test: the fast tier's peak resident memory
must stay under a laptop's (it once grew to 22 GB in one process), and a test that compiles too
much must be named the day it lands, not when CI runs out of its 90 minutes.

Every run prints, at its end, its wall time and peak memory (the pytest process plus every
process it started, sampled), the slow tests' peaks one by one, and the heaviest others.
``JAXRL_TEST_BUDGET=enforce`` (CI sets it) turns the budget into a failure: the run fails
when its wall time, one test's time (setup + call + teardown) or the peak memory exceeds
the limits in ``[tool.pytest.ini_options]`` of pyproject.toml, naming the offenders. Off by
default: a test's outcome never depends on the machine's speed.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ENV = "JAXRL_TEST_BUDGET"
_PAGE = os.sysconf("SC_PAGE_SIZE")
_SAMPLE_S = 0.25
_PEAK_KEY = "budget_peak_bytes"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini("budget_wall_s", "fast tier: most seconds for the whole run", default="720")
    parser.addini("budget_test_s", "fast tier: most seconds for one test (setup + call + teardown)", default="30")
    parser.addini("budget_rss_gb", "fast tier: most GB of peak resident memory (process tree)", default="6")


def _rss(pid: int) -> int:
    """Resident bytes of one process (0 once it is gone)."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                kids = [int(k) for k in Path(f"/proc/{p}/task/{t}/children").read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def _self_peak_and_reset() -> int:
    """This process's resident high-water mark since the last reset (VmHWM), then reset it."""
    peak = 0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            peak = int(line.split()[1]) * 1024
    try:
        Path("/proc/self/clear_refs").write_text("5")  # 5: reset the high-water mark (Linux >= 4.0)
    except OSError:
        pass
    return peak


@dataclass
class _Sampler:
    """Samples the resident memory of this process and its descendants in a daemon thread."""

    peak: int = 0  # since the last take()
    overall: int = 0  # since start()
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> None:
        threading.Thread(target=self._run, name="budget-rss", daemon=True).start()

    def _run(self) -> None:
        me = os.getpid()
        while not self._stop.wait(_SAMPLE_S):
            total = _rss(me) + sum(_rss(p) for p in _descendants(me))
            self.peak = max(self.peak, total)
            self.overall = max(self.overall, total)

    def take(self) -> int:
        """The peak since the last take, then start a new window."""
        peak, self.peak = self.peak, 0
        return peak

    def stop(self) -> None:
        self._stop.set()


@dataclass
class _Record:
    seconds: float = 0.0
    peak: int = 0
    slow: bool = False


class Budget:
    def __init__(self, config: pytest.Config) -> None:
        self.enforce = os.environ.get(ENV, "") == "enforce"
        if os.environ.get(ENV, "") not in ("", "enforce", "report"):
            raise pytest.UsageError(f"{ENV}={os.environ[ENV]!r}: use 'enforce' (fail over budget) or 'report'")
        self.wall_s = float(config.getini("budget_wall_s"))
        self.test_s = float(config.getini("budget_test_s"))
        self.rss = float(config.getini("budget_rss_gb")) * 1e9
        self.records: dict[str, _Record] = {}
        self.start = time.monotonic()
        self.sampler = _Sampler()
        self.sampler.start()
        self.peak = 0
        self.violations: list[str] = []

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item):
        _self_peak_and_reset()  # a new window for this test's peak
        self.sampler.take()
        yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        """The test's peak rides on its teardown report: with pytest-xdist the test runs in a
        worker process and only its reports reach the process that prints the budget."""
        outcome = yield
        if call.when == "teardown":
            peak = max(_self_peak_and_reset(), self.sampler.take())
            outcome.get_result().user_properties.append((_PEAK_KEY, peak))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        # A subtest's report (schemathesis) has a node id of its own: its markers say its tier.
        rec = self.records.setdefault(report.nodeid, _Record(slow="slow" in report.keywords))
        rec.seconds += report.duration
        for key, value in report.user_properties:
            if key == _PEAK_KEY:
                rec.peak = max(rec.peak, value)
                self.peak = max(self.peak, value)

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.sampler.stop()
        self.peak = max(self.peak, self.sampler.overall)  # with xdist: the workers are this process's children
        self.wall = time.monotonic() - self.start
        fast = {k: r for k, r in self.records.items() if not r.slow}
        if not fast:
            return  # the slow tier alone: reported, not budgeted
        slow_tests = [k for k, r in fast.items() if r.seconds > self.test_s]
        self.violations += [f"{k}: {fast[k].seconds:.1f} s > {self.test_s:g} s per test" for k in slow_tests]
        if self.wall > self.wall_s:
            self.violations.append(f"the run: {self.wall:.0f} s > {self.wall_s:.0f} s")
        if self.peak > self.rss:
            heavy = max(fast, key=lambda k: fast[k].peak)
            self.violations.append(f"peak memory {self.peak / 1e9:.2f} GB > {self.rss / 1e9:.1f} GB (at {heavy})")
        if self.enforce and self.violations and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.records:
            return  # nothing ran (--collect-only, or no test selected)
        tr = terminalreporter
        tr.section("time and memory budget")
        tr.write_line(f"wall {self.wall:.0f} s, peak resident memory {self.peak / 1e9:.2f} GB "
                      f"(pytest and its child processes; budget for the fast tier: {self.wall_s:.0f} s, "
                      f"{self.test_s:.0f} s a test, {self.rss / 1e9:.1f} GB)")
        slow = sorted((k for k, r in self.records.items() if r.slow), key=lambda k: -self.records[k].peak)
        for k in slow:
            r = self.records[k]
            tr.write_line(f"  slow  {r.peak / 1e9:5.2f} GB {r.seconds:7.1f} s  {k}")
        others = sorted((k for k, r in self.records.items() if not r.slow), key=lambda k: -self.records[k].peak)
        for k in others[:5]:
            r = self.records[k]
            tr.write_line(f"  fast  {r.peak / 1e9:5.2f} GB {r.seconds:7.1f} s  {k}")
        if self.violations:
            verdict = "FAILED" if self.enforce else f"not enforced (set {ENV}=enforce)"
            tr.write_line(f"over budget, {verdict}:", red=True, bold=True)
            for v in self.violations:
                tr.write_line(f"  {v}", red=True)


class _WorkerBudget(Budget):
    """In a pytest-xdist worker: measures each test's peak onto its reports; the controller
    (whose process tree holds every worker) adds up, prints and enforces."""

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.sampler.stop()

    def pytest_terminal_summary(self, terminalreporter) -> None:
        pass


def pytest_configure(config: pytest.Config) -> None:
    worker = hasattr(config, "workerinput")  # set by pytest-xdist in its workers
    config.pluginmanager.register((_WorkerBudget if worker else Budget)(config), "jaxrl-budget")
