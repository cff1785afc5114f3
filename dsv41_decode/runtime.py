"""How the command line runs CPU work: the thread count it gives torch, and progress that shows.

- `cpu_threads()`: the thread count for torch's CPU kernels. `--threads N` wins, then
  `OMP_NUM_THREADS`; otherwise min(4, physical cores, cores idle right now), at least 1. The idle
  cores are measured from /proc/stat over 0.1 s (Linux; elsewhere the 1-minute load average): on a
  machine whose cores are busy with other work, torch's OpenMP threads wait on each other at every
  kernel, and more threads than idle cores is several times slower than one thread (the demo on 2
  cores with one of them busy: 7 s with 1 thread, 35 s with 2).
- `Steps`: progress over a known number of steps: a transient bar on a terminal, and one line per
  step on stderr otherwise (a pipe or a CI log still shows that long work is moving).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

MAX_THREADS = 4   # the reference's CPU kernels are small: more threads than this gain nothing


def physical_cores() -> int:
    """Cores this process may run on, counting hyperthread siblings once (sysfs topology; Linux)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1
    cores = set()
    for c in cpus:
        p = Path(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list")
        try:
            cores.add(p.read_text().strip())
        except OSError:
            cores.add(str(c))
    return max(1, len(cores))


def _cpu_times() -> tuple[int, int] | None:
    """(idle, total) jiffies of all CPUs from /proc/stat, or None where there is none."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return fields[3] + (fields[4] if len(fields) > 4 else 0), sum(fields)


def idle_cores(window_s: float = 0.1) -> float:
    """How many of the machine's cores were idle over the last `window_s` seconds (an estimate)."""
    n = os.cpu_count() or 1
    a = _cpu_times()
    if a is None:
        return max(0.0, n - os.getloadavg()[0]) if hasattr(os, "getloadavg") else float(n)
    time.sleep(window_s)
    b = _cpu_times()
    total = b[1] - a[1]
    return n * (b[0] - a[0]) / total if total > 0 else float(n)


def cpu_threads(requested: int | None = None) -> tuple[int, str]:
    """(threads, why): `requested` (the --threads option), else OMP_NUM_THREADS, else
    min(MAX_THREADS, physical cores, idle cores rounded), at least 1."""
    if requested is not None:
        return requested, "--threads"
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env), "OMP_NUM_THREADS"
    idle = idle_cores()
    n = max(1, min(MAX_THREADS, physical_cores(), int(idle + 0.5)))
    return n, f"min({MAX_THREADS}, {physical_cores()} physical cores, {idle:.1f} idle)"


class Steps:
    """Progress over `total` steps named `label`: `advance(note)` after each one.

    On a terminal (`console.is_terminal`) a transient rich bar; otherwise one line per step,
    `label k/total: note`, on stderr (flushed), so piped output still shows progress. `quiet`
    shows nothing.
    """

    def __init__(self, label: str, total: int, console=None, quiet: bool = False) -> None:
        self.label, self.total, self.done = label, total, 0
        self.quiet = quiet
        self._bar = None
        if not quiet and console is not None and console.is_terminal:
            from rich.progress import Progress
            self._bar = Progress(console=console, transient=True)
            self._task = self._bar.add_task(label, total=total)
            self._bar.start()

    def advance(self, note: str = "") -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.advance(self._task)
        elif not self.quiet:
            print(f"{self.label} {self.done}/{self.total}{': ' + note if note else ''}", file=sys.stderr,
                  flush=True)

    def close(self) -> None:
        """Remove the bar (nothing to do for lines)."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    stop = close

    def __enter__(self) -> "Steps":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
