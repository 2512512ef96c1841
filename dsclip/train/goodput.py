"""Goodput: where a run's wall time goes, by kind, for this start and summed over every start of the run.

One :class:`Goodput` ledger per process. It keeps a *mark* (the last instant accounted for); every second
between the process's start and the report is given to exactly one kind, so the kinds sum to the wall time
by construction:

- :meth:`Goodput.tick` gives the time since the mark to a kind (the loop: ``tick("data_wait")`` when a step's
  batches are in, ``tick("step")`` when the step is done);
- :meth:`Goodput.span` gives the time inside a ``with`` block to a kind (``with goodput.span("save"): ...``);
  the time before it goes to the enclosing kind: the enclosing span's, or the *base* kind (``startup`` until
  the step loop begins, then ``other``; ``stop`` once a stop is decided). Spans nest; a second is counted
  once, in the innermost span.

Overlapping work (the background write of an asynchronous save) runs while steps go on: :meth:`Goodput.add`
records its seconds apart, reported next to the shares and not part of the 100 %.

Rank 0's ledger is the run's (the ranks move in step through the collectives). It persists as
``RUN/goodput/start-*.json``, one file per start of the run (written at every checkpoint, at the end, and on
a stop, hang or error), and :func:`run_report` sums every start's file: a requeued run's goodput covers all its
jobs. (A start killed outright loses the seconds after its last write; a new run, not ``--resume``, clears the
folder and with it the earlier run's files.) The time a job waits in the queue between starts is no one's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path

# the kinds of a start's wall time, in the order the end line names them, with the words it uses
KINDS = {
    "step": "steps",
    "data_wait": "input wait",
    "startup": "start-up",
    "resume": "resume load",
    "save": "save stalls",
    "eval": "evaluations",
    "stop": "stop/hang handling",
    "other": "other",
}
OVERLAPPING = {"background_write": "background writes"}  # beside the steps, not part of the wall time's 100 %
LEDGER_DIR = "goodput"

log = logging.getLogger("dsclip")


def process_start(clock: Callable[[], float] = time.perf_counter) -> float:
    """The process's start on ``clock``'s scale: the kernel's start time of this process (Linux /proc; it
    includes the interpreter's start and the imports), else now."""
    now = clock()
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return now
    return now - max(uptime - ticks / os.sysconf("SC_CLK_TCK"), 0.0)


class Goodput:
    """This start's ledger (see the module docstring). ``start``: where its clock begins on ``clock``'s scale
    (`dsclip train` passes :func:`process_start`; default: now)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, start: float | None = None):
        self.clock = clock
        self.start = clock() if start is None else start
        self.mark = self.start
        self.seconds = dict.fromkeys(KINDS, 0.0)
        self.overlap = dict.fromkeys(OVERLAPPING, 0.0)
        self.base = "startup"
        self._stack: list[str] = []
        self._warned = False
        self.path: Path | None = None  # RUN/goodput/start-*.json on rank 0, once the run folder is known
        self.started_unix = time.time() - (clock() - self.start)  # the clock's start on the wall clock

    # -- ticking -------------------------------------------------------------------------------------------
    @property
    def current(self) -> str:
        return self._stack[-1] if self._stack else self.base

    def tick(self, kind: str | None = None) -> float:
        """Give the time since the mark to ``kind`` (default: the current kind); returns those seconds."""
        now = self.clock()
        elapsed = max(now - self.mark, 0.0)
        self.seconds[kind or self.current] += elapsed
        self.mark = now
        return elapsed

    @contextlib.contextmanager
    def span(self, kind: str) -> Iterator[None]:
        """The block's time to ``kind`` (the time before it to the enclosing kind)."""
        self.tick()
        self._stack.append(kind)
        try:
            yield
        finally:
            self.tick()
            self._stack.pop()

    def set_base(self, kind: str) -> None:
        """From now on, time outside any span goes to ``kind`` (the time until now to the previous base)."""
        self.tick()
        self.base = kind

    def add(self, kind: str, seconds: float) -> None:
        """Overlapping seconds (``background_write``: an asynchronous save's write while steps go on)."""
        if kind not in OVERLAPPING:
            raise ValueError(f"{kind!r} is not an overlapping kind ({', '.join(OVERLAPPING)}): use span() or tick()")
        self.overlap[kind] += max(float(seconds), 0.0)

    # -- reporting -----------------------------------------------------------------------------------------
    def ledger(self) -> dict:
        """This start so far: the time up to now given to the current kind first, so it sums to its wall."""
        self.tick()
        return {
            "started": datetime.fromtimestamp(self.started_unix, timezone.utc).isoformat(timespec="milliseconds"),
            "started_unix": self.started_unix,
            "wall_s": self.mark - self.start,
            "seconds": dict(self.seconds),
            "overlap_s": dict(self.overlap),
        }

    def attach(self, run_dir: Path) -> None:
        """Persist to ``RUN/goodput/start-<UTC start>-<pid>.json`` (rank 0 calls it, holding the run lock)."""
        stamp = datetime.fromtimestamp(self.started_unix, timezone.utc).strftime("%Y%m%dT%H%M%S")
        self.path = Path(run_dir) / LEDGER_DIR / f"start-{stamp}-{os.getpid()}.json"

    def save(self) -> dict:
        """Write this start's ledger (atomically; nothing without :meth:`attach`) and return it. A write that
        fails (a full disk) is logged once and never stops training: only this start's seconds go uncounted."""
        entry = self.ledger()
        if self.path is not None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                tmp = self.path.with_name("." + self.path.name + ".tmp")
                tmp.write_text(json.dumps(entry) + "\n")
                os.replace(tmp, self.path)
            except OSError as e:
                if not self._warned:
                    log.warning("goodput: %s not written (%s); this start's seconds may go uncounted", self.path, e)
                self._warned = True
        return entry

    def report(self) -> dict:
        """The run's report: every start's ledger in the run folder summed (this one's as of now), and this
        start's alone under ``this_start``."""
        mine = self.save()
        others = []
        if self.path is not None:
            others = [p for p in sorted(self.path.parent.glob("start-*.json")) if p != self.path]
        return {**summarize([mine, *(_read(p) for p in others)]), "this_start": summarize([mine])}


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # a start killed while writing leaves only its .tmp: never a half file
        return None


def summarize(ledgers: list[dict | None]) -> dict:
    """Summed ledgers -> {"starts", "wall_s", "seconds", "shares", "goodput", "overlap_s"}; the shares are of
    the summed wall time, and goodput is the steps' share (input waits are their own kind)."""
    ledgers = [x for x in ledgers if x]
    wall = sum(x["wall_s"] for x in ledgers)
    seconds = {k: sum(x["seconds"].get(k, 0.0) for x in ledgers) for k in KINDS}
    overlap = {k: sum(x.get("overlap_s", {}).get(k, 0.0) for x in ledgers) for k in OVERLAPPING}
    shares = {k: (v / wall if wall > 0 else 0.0) for k, v in seconds.items()}
    return {
        "starts": len(ledgers),
        "wall_s": wall,
        "goodput": shares["step"],
        "seconds": seconds,
        "shares": shares,
        "overlap_s": overlap,
    }


def summary_text(report: dict) -> str:
    """The end line's part: ``goodput 81.2% of 1h02m over 2 starts (steps 81.2%, input wait 3.1%, ...)``."""
    from dsclip.train.progress import format_duration

    parts = [f"{KINDS[k]} {100 * s:.1f}%" for k, s in report["shares"].items() if s >= 0.0005 or k == "step"]
    starts = report["starts"]
    text = (
        f"goodput {100 * report['goodput']:.1f}% of {format_duration(report['wall_s'])}"
        + (f" over {starts} starts" if starts > 1 else "")
        + f" ({', '.join(parts)})"
    )
    over = [f"{OVERLAPPING[k]} {s:.1f} s" for k, s in report["overlap_s"].items() if s > 0]
    return text + (f" + {', '.join(over)} overlapping the steps (not in the 100%)" if over else "")


def scalars(report: dict) -> dict[str, float]:
    """TensorBoard/wandb names: ``goodput/goodput`` and ``goodput/<kind>_share``, ``goodput/<overlap>_s``."""
    out = {"goodput/goodput": report["goodput"], "goodput/wall_s": report["wall_s"]}
    out.update({f"goodput/{k}_share": v for k, v in report["shares"].items()})
    out.update({f"goodput/{k}_s": v for k, v in report["overlap_s"].items()})
    return out
