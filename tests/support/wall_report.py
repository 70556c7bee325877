"""Wall time per pytest-xdist worker and per module, printed at the end of every run beside the CPU per tier.

The suite's wall target (tests ≤ 15 min on a quiet 2-core machine) is missed either because the workers' loads are
uneven (one worker ends minutes before the other: the module order, `MEASURED_S` in tests/conftest.py, is stale) or
because both workers wait inside tests (servers, browsers, sleeps: the CPU is idle although both are busy). These
lines tell which: each worker's span from its first test's start to its last test's end, the seconds inside tests,
and the longest modules, whose seconds are what `MEASURED_S` should say.
"""

from __future__ import annotations

import time


class WallReport:
    def __init__(self, worker: str = "main") -> None:
        self.worker = worker
        self.first: float | None = None
        self.last: float | None = None
        self.modules: dict[str, float] = {}
        self.workers: dict[str, dict] = {}  # the controller's: worker -> its as_dict()

    def add(self, module: str, start: float, end: float) -> None:
        """One test's setup-to-teardown span (time.time(): comparable across the workers' processes)."""
        self.first = start if self.first is None else min(self.first, start)
        self.last = end if self.last is None else max(self.last, end)
        self.modules[module] = self.modules.get(module, 0.0) + (end - start)

    def as_dict(self) -> dict:
        return {"first": self.first, "last": self.last, "modules": dict(self.modules)}

    def merge(self, worker: str, data: dict) -> None:
        if data.get("first") is not None:
            self.workers[worker] = data

    def lines(self, top: int = 15) -> list[str]:
        workers = self.workers or ({self.worker: self.as_dict()} if self.first is not None else {})
        if not workers:
            return []
        start = min(data["first"] for data in workers.values())
        rows = [f"{'worker':<8} {'starts':>7} {'ends':>7} {'in tests':>9}   (minutes from the first test's start)"]
        modules: dict[str, float] = {}
        for name in sorted(workers):
            data = workers[name]
            inside = sum(data["modules"].values())
            rows.append(f"{name:<8} {(data['first'] - start) / 60:>7.1f} {(data['last'] - start) / 60:>7.1f} "
                        f"{inside / 60:>9.1f}")
            for module, seconds in data["modules"].items():
                modules[module] = modules.get(module, 0.0) + seconds
        longest = sorted(modules.items(), key=lambda item: -item[1])[:top]
        rows.append("longest modules (s): " + ", ".join(f"{module} {seconds:.0f}" for module, seconds in longest))
        return rows


def now() -> float:
    return time.time()
