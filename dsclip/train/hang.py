"""A hung rank ends the job in minutes, not after the 30-minute process-group timeout (issue 58).

:class:`HangGuard` is the loop's side of it. The first :data:`ARM_AFTER_STEPS` steps of a start run under
the long timeout (compilation, loader start, the resumed checkpoint's first use); after them it

- shortens every process group's timeout to ``--collective-timeout`` (at least ``--step-timeout-factor`` ×
  the slowest of those steps, since an NCCL collective's clock starts when the host enqueues it; never
  longer than the long timeout),
- starts the step watchdog (dsclip.engine.world.watchdog): a step longer than max(``--step-timeout``,
  ``--step-timeout-factor`` × the slowest of the last 20 steps) is a hang,
- and gives checkpoint saves and evaluations (:meth:`HangGuard.slow`) the long timeout back.

Whichever fires first (the watchdog from its thread, or a collective's timeout error in the main thread:
:meth:`HangGuard.collective_timed_out`) ends this rank the same way: one ``dsclip train: error:`` line
(:func:`hang_line`: the stuck rank where known, the last finished step, ``latest``, the command that
resumes), ``exit_status.json`` "stop": "hung" from rank 0, logs flushed, ``os._exit(2)``: a thread blocked
in a collective cannot be unwound, and the interpreter's exit would wait in the process group's teardown.
Nothing is saved: ``latest`` still names the last complete checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

from dsclip.engine.ds_config import TrainArgs
from dsclip.engine.world import process_group, watchdog

log = logging.getLogger("dsclip")

ARM_AFTER_STEPS = 2  # steps of this start run under the long timeout
EXIT_HUNG = 2  # what a user error exits with: not requeued by the batch scripts (a hung node needs a look)


class HangGuard:
    """Arms the short bounds after the first steps, keeps them out of saves and evaluations, ends a hang.

    ``latest``: reads the checkpoint ``latest`` names (None: none yet); ``argv``: this rank's ``dsclip``
    arguments (for the resume command). ``clock`` and ``store`` are for tests."""

    def __init__(
        self,
        train: TrainArgs,
        *,
        rank: int,
        world_size: int,
        run_dir: Path,
        name: str,
        latest: Callable[[], str | None],
        start_step: int = 0,
        argv: list[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        store=None,
        goodput=None,
    ):
        self.train, self.rank, self.world_size = train, rank, world_size
        self.run_dir, self.name, self.latest, self.clock = Path(run_dir), name, latest, clock
        self.argv = command_args() if argv is None else argv
        self.long = process_group.long_timeout()
        self.short: timedelta | None = None  # the collective timeout in force between saves, once armed
        self.in_force = self.long  # the collective timeout of the moment, and what it is for (None: a step)
        self.during: str | None = None
        self._ending = threading.Lock()  # the watchdog's thread and the main thread may both find the hang
        self.last_step = start_step
        self._warmup: list[float] = []
        self._since = clock()
        self._store = store
        self.watchdog: watchdog.StepWatchdog | None = None
        self.goodput = goodput  # the start's dsclip.train.goodput.Goodput: a hang's wait is stop/hang handling

    @property
    def armed(self) -> bool:
        return self.short is not None or self.watchdog is not None

    def step_done(self, step: int) -> None:
        """The loop finished ``step`` (every rank calls it after every step)."""
        self.last_step = step
        if self.watchdog is not None:
            self.watchdog.step_done(step)
            return
        now = self.clock()
        self._warmup.append(now - self._since)
        self._since = now
        if len(self._warmup) == ARM_AFTER_STEPS:
            self.arm()

    def arm(self) -> str:
        """Short collective timeout and the watchdog from here on; returns (rank 0 prints) the line saying so."""
        t, slowest = self.train, max(self._warmup, default=0.0)
        parts = []
        if t.collective_timeout > 0:
            # never longer than the process group's own (DSCLIP_DIST_TIMEOUT=10 stays 10 s)
            seconds = min(self.long.total_seconds(), max(t.collective_timeout, t.step_timeout_factor * slowest))
            self.short = self.in_force = timedelta(seconds=seconds)
            process_group.set_collective_timeout(self.short)
            parts.append(f"collective timeout {seconds:g} s")
        if t.step_timeout > 0:
            liveness = None
            if self.world_size > 1:
                store = self._store if self._store is not None else watchdog.side_store()
                if store is not None:
                    liveness = watchdog.Liveness(store, self.rank, self.world_size)
            bound = watchdog.StepBound(t.step_timeout, t.step_timeout_factor)
            self.watchdog = watchdog.StepWatchdog(
                bound, on_hang=self.on_hang, last_step=self.last_step, clock=self.clock, liveness=liveness
            )
            self.watchdog.start()
            parts.append(
                f"step watchdog max({t.step_timeout:g} s, {t.step_timeout_factor:g} x slowest of the last 20 steps)"
            )
        line = (
            f"dsclip: hang bounds from step {self.last_step + 1}: " + (", ".join(parts) or "off")
            + f"; saves and evaluations {self.long.total_seconds():g} s"
        )  # fmt: skip
        if self.rank == 0:
            from dsclip.train.metrics import console

            console(line)
        return line

    @contextlib.contextmanager
    def slow(self, what: str) -> Iterator[None]:
        """A checkpoint save or an evaluation (collective, and legitimately slow): the long timeout, for
        collectives and for the watchdog, while it runs."""
        if not self.armed:
            yield
            return
        if self.short is not None:
            process_group.set_collective_timeout(self.long)
        self.in_force, self.during = self.long, what
        phase = self.watchdog.phase(what, self.long.total_seconds()) if self.watchdog else contextlib.nullcontext()
        with phase:
            yield
        self.in_force, self.during = self.short or self.long, None
        if self.short is not None:
            process_group.set_collective_timeout(self.short)

    def close(self) -> None:
        """Training is over (or failed): the watchdog stops, the long timeout is back for what follows."""
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
        self.in_force, self.during = self.long, None
        if self.short is not None:
            self.short = None
            # after a lost peer the groups may be broken: that error, not this one, is the run's
            with contextlib.suppress(RuntimeError):
                process_group.set_collective_timeout(self.long)

    # --- the end of a hung rank -------------------------------------------------------------------------

    def on_hang(self, found: watchdog.Overdue) -> None:
        """The watchdog's verdict (called from its thread)."""
        stuck = self.stuck(found.limit_s)
        line = hang_line(
            rank=self.rank,
            what=f"{found.what} has run {found.elapsed_s:.0f} s (bound {found.bound})",
            stuck=stuck,
            last_step=found.last_step,
            latest=self.latest(),
            resume=resume_command(self.argv, self.name),
        )
        self.end(line)

    def collective_timed_out(self, why: str) -> None:
        """A collective of the main thread gave up after the process group's timeout (gloo raises it there;
        NCCL's own watchdog aborts the process instead, after dumping the flight recorder)."""
        timeout = self.in_force.total_seconds()
        of = f"the {self.during}" if self.during else f"step {self.last_step + 1}"
        line = hang_line(
            rank=self.rank,
            what=f"a collective of {of} waited out the {timeout:g} s collective timeout ({why})",
            stuck=self.stuck(timeout),
            last_step=self.last_step,
            latest=self.latest(),
            resume=resume_command(self.argv, self.name),
        )
        self.end(line)

    def stuck(self, waited_s: float) -> str:
        """Which rank the job waits for, as far as this one can tell (see :func:`stuck_text`)."""
        live = self.watchdog.liveness if self.watchdog is not None else None
        poll = self.watchdog.poll_s if self.watchdog is not None else 5.0
        # a frozen peer stopped stamping when the wait began (or earlier): older than half of it, and older than
        # a few of the live ranks' stamp periods plus a margin for the clocks of different hosts
        silent = live.silent(min(waited_s / 2, 3 * poll + 2.0)) if live is not None else None
        return stuck_text(self.rank, self.world_size, silent, store_asked=live is not None)

    def end(self, line: str) -> None:
        """Say ``line``, record the stop, exit :data:`EXIT_HUNG` now (never returns)."""
        from dsclip.launch import supervise
        from dsclip.train import runlog

        if not self._ending.acquire(blocking=False):
            threading.Event().wait()  # the other finder says it and ends the process
        error = f"dsclip train: error: {line}"
        sys.stderr.write(error + "\n")
        sys.stderr.flush()
        if log.hasHandlers():  # into RUN/out.log; without a handler logging's last resort would print it again
            log.error(line)
        if self.rank == 0:
            try:
                report = None
                if self.goodput is not None:  # the hung step's time, from its start to this line, is the hang's
                    self.goodput.tick("stop")
                    report = self.goodput.report()
                runlog.write_exit_status(
                    self.run_dir, exit_code=EXIT_HUNG, stop="hung", step=self.last_step, checkpoint=self.latest(),
                    goodput=report,
                )  # fmt: skip
            except OSError as e:
                sys.stderr.write(f"dsclip: exit_status.json not written: {e}\n")
        supervise.report_exit(EXIT_HUNG)
        _flush_logs()
        os._exit(EXIT_HUNG)


NO_STORE = "the job's store does not answer: the process that hosts it, rank 0 under deepspeed or srun, is frozen"
ALL_ALIVE = "every process is alive: one rank's step is blocked outside the collectives, e.g. on its data"


def stuck_text(rank: int, world_size: int, silent: dict[int, float | None] | None, *, store_asked: bool) -> str:
    """Who is stuck: the ranks whose sign of life stopped (``silent``: rank → seconds since its last stamp,
    None: never stamped), else what can be said without them."""
    if world_size == 1:
        return "this rank (a world of 1: the step itself is blocked, e.g. on its data)"
    if silent:
        ranks = sorted(silent)
        ages = [a for a in silent.values() if a is not None]
        since = f" for {min(ages):.0f} s" if ages else ""
        who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
        return f"{who} (no sign of life{since}: stopped or frozen)"
    other = f"rank {1 - rank}" if world_size == 2 else None
    if not store_asked:
        return other or f"a peer of {world_size} ranks"
    if silent is None:
        return f"{other or 'rank 0 or a peer'} ({NO_STORE})"
    return f"{other + ' or this one' if other else f'a peer of {world_size} ranks'} ({ALL_ALIVE})"


def hang_line(*, rank: int, what: str, stuck: str, last_step: int, latest: str | None, resume: str) -> str:
    """The one line a hung rank says (without the ``dsclip train: error:`` prefix)."""
    kept = f"latest names {latest}, untouched (a hang saves nothing)" if latest else "no checkpoint was saved yet"
    return (
        f"rank {rank}: hung: {what}; stuck: {stuck}; last step done: {last_step}; {kept}; "
        f"continue with --resume latest: {resume}"
    )


def command_args(argv: list[str] | None = None) -> list[str]:
    """This rank's arguments after ``train`` (``python -m dsclip train ...``, ``dsclip train ...``), launcher
    additions (``--local_rank=N``) dropped."""
    argv = list(sys.argv if argv is None else argv)
    rest = argv[argv.index("train") + 1 :] if "train" in argv else []
    return [a for a in rest if not a.startswith(("--local_rank=", "--local-rank="))]


def resume_command(args: list[str], name: str) -> str:
    """``dsclip train ARGS`` with ``--resume latest`` (replacing any other ``--resume``) and the run's
    ``--name`` (the clock's default name is not what a new start would choose)."""
    out, i, named = [], 0, False
    while i < len(args):
        a = args[i]
        if a == "--resume":
            i += 2
            continue
        if a.startswith("--resume="):
            i += 1
            continue
        named = named or a == "--name" or a.startswith("--name=")
        out.append(a)
        i += 1
    if not named:
        out += ["--name", name]
    return shlex.join(["dsclip", "train", *out, "--resume", "latest"])


def _flush_logs() -> None:
    for logger in (logging.getLogger("dsclip"), logging.getLogger("dsclip.console")):
        for h in logger.handlers:
            with contextlib.suppress(Exception):
                h.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
