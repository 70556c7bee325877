"""CPU-seconds per tier, printed at the end of every run (issue: the suite's CPU is a budget, seen in each CI log).

Each test's CPU is the change, across its setup, call and teardown, of its process's own user+sys time plus the time
of the child processes it reaped (servers, CLI runs, ranks, ComfyUI; commands forked by support/warm_cli.py's fork
server count when the test sees them end): a server a module fixture starts is counted when
its teardown reaps it, in the tier of the module's last test; session-wide servers in the run's last test. Processes
never reaped (daemons that outlive the run) are not counted: the harness stops and waits for each it starts.
Under pytest-xdist each worker sends its totals to the controller, which prints the sum.
"""

from __future__ import annotations

import os

#: The order a test's markers name its tier: the heaviest marker it carries.
TIER_ORDER = ("ray", "comfyui", "process", "slow")


def tier_of(markers: set[str]) -> str:
    return next((name for name in TIER_ORDER if name in markers), "fast")


def cpu_seconds() -> float:
    """User + sys CPU of this process and of every child it has reaped, the commands it forked warm included."""
    from . import warm_cli

    times = os.times()
    return times.user + times.system + times.children_user + times.children_system + warm_cli.reaped_cpu_seconds()


class CpuByTier:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.tests: dict[str, int] = {}

    def add(self, tier: str, seconds: float, tests: int = 1) -> None:
        self.seconds[tier] = self.seconds.get(tier, 0.0) + seconds
        self.tests[tier] = self.tests.get(tier, 0) + tests

    def merge(self, data: dict) -> None:
        for tier, seconds in data.get("seconds", {}).items():
            self.add(tier, seconds, data.get("tests", {}).get(tier, 0))

    def as_dict(self) -> dict:
        return {"seconds": dict(self.seconds), "tests": dict(self.tests)}

    def lines(self) -> list[str]:
        order = ["fast", *reversed(TIER_ORDER)]
        rows = [f"{'tier':<8} {'tests':>6} {'CPU-min':>8}"]
        for tier in sorted(self.seconds, key=lambda name: order.index(name) if name in order else len(order)):
            rows.append(f"{tier:<8} {self.tests.get(tier, 0):>6} {self.seconds[tier] / 60:>8.1f}")
        rows.append(f"{'total':<8} {sum(self.tests.values()):>6} {sum(self.seconds.values()) / 60:>8.1f}")
        return rows
