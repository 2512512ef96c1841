"""The mechanism that bounds a hung job: a step-time watchdog thread, the ranks' signs of life in the job's
store, and torch's flight-recorder variables. What a hang says and how the run ends: dsclip.train.hang.

A rank that hangs without dying (SIGSTOP, a wedged driver, a dead NFS mount under the data loader) leaves
its peers waiting in a collective, and a collective only gives up after the process group's timeout (30
min by default), and on CPU/gloo some waits inside a ZeRO-2 step were seen to ignore even that. The main
thread of a waiting rank cannot be interrupted, so the bound is kept by a thread of its own:

- :class:`StepWatchdog`: the loop reports each finished step (:meth:`~StepWatchdog.step_done`); a step
  that runs longer than :meth:`StepBound.limit` (max(floor, factor × the slowest of the last 20 steps))
  calls ``on_hang`` from the thread. Checkpoint saves and evaluations run in a :meth:`~StepWatchdog.phase`
  with a limit of their own (they may legitimately take minutes) and do not count as step time; one that
  outlives the step bound while a peer gives no sign of life for as long is a hang too (every rank takes
  part in a save, so a frozen one holds it forever).
- :class:`Liveness`: every poll the thread stamps this rank's wall-clock time into the job's store; a
  rank whose stamp stopped moving is frozen as a whole process (SIGSTOP, swapped out, its node gone),
  which is how a survivor of a 512-rank job names the rank it waits for. A rank whose main thread is stuck
  while the process lives (waiting in the collective like the others, or on its data) keeps stamping.
- :func:`flight_recorder_env`: TORCH_FR_* / TORCH_NCCL_* set where the user left them unset, so an NCCL
  collective that times out dumps what every rank was doing into the logs folder.

No clock is read where one can be passed: the unit tests drive :meth:`StepWatchdog.overdue` with a fake
clock and never start the thread.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

HISTORY = 20  # steps the bound looks back on


@dataclass(frozen=True)
class StepBound:
    """How long one step may run: max(``floor_s``, ``factor`` × the slowest of the recent steps)."""

    floor_s: float
    factor: float

    def limit(self, recent) -> float:
        return max(self.floor_s, self.factor * max(recent, default=0.0))

    def describe(self, recent) -> str:
        slowest = max(recent, default=0.0)
        return f"max({self.floor_s:g} s, {self.factor:g} x slowest recent step {slowest:.2f} s)"


@dataclass(frozen=True)
class Overdue:
    """What the watchdog found: ``what`` ("step 7", "checkpoint save") has run ``elapsed_s`` > ``limit_s``."""

    what: str
    last_step: int  # the last step that finished
    elapsed_s: float
    limit_s: float
    bound: str  # how the limit was made ("max(180 s, 10 x slowest recent step 0.41 s) = 180 s")


class StepWatchdog:
    """Fed by the training loop, checked by its own daemon thread (:meth:`start`).

    ``clock`` is a monotonic clock in seconds; ``poll_s`` how often the thread looks (and stamps
    ``liveness``). The limit in force is the step bound, or a phase's own while one is open."""

    def __init__(
        self,
        bound: StepBound,
        *,
        on_hang: Callable[[Overdue], None],
        last_step: int = 0,
        clock: Callable[[], float] = time.monotonic,
        poll_s: float | None = None,
        liveness: Liveness | None = None,
    ):
        self.bound = bound
        self.on_hang = on_hang
        self.clock = clock
        self.poll_s = poll_s if poll_s is not None else max(0.1, min(5.0, bound.floor_s / 10))
        # how often a long phase asks the store about the other ranks (each asks for every stamp: rarer than polls)
        self.peer_check_s = max(self.poll_s, min(30.0, bound.floor_s / 6))
        self._peer_checked = float("-inf")
        self._store_silent = 0  # consecutive peer checks the store did not answer
        self.liveness = liveness
        self.last_step = last_step
        self._recent: deque[float] = deque(maxlen=HISTORY)
        self._since = clock()
        self._phase: tuple[str, float] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def step_done(self, step: int) -> None:
        now = self.clock()
        with self._lock:
            self._recent.append(now - self._since)
            self._since, self.last_step = now, step

    @property
    def slowest_s(self) -> float:
        with self._lock:
            return max(self._recent, default=0.0)

    @contextlib.contextmanager
    def phase(self, what: str, limit_s: float) -> Iterator[None]:
        """``what`` (a checkpoint save, an evaluation) is bounded by ``limit_s`` instead of the step bound,
        and its time is not step time: the next step's clock starts when it ends."""
        with self._lock:
            outer, self._phase, self._since = self._phase, (what, limit_s), self.clock()
        try:
            yield
        finally:
            with self._lock:
                self._phase, self._since = outer, self.clock()

    def overdue(self, now: float | None = None) -> Overdue | None:
        """The running step (or phase) if it has outlived its limit, else None."""
        now = self.clock() if now is None else now
        with self._lock:
            elapsed = now - self._since
            if self._phase is not None:
                what, limit = self._phase
                bound = f"{limit:g} s for a {what}"
            else:
                what, limit = f"step {self.last_step + 1}", self.bound.limit(self._recent)
                bound = f"{self.bound.describe(self._recent)} = {limit:.0f} s"
            if limit > 0 and elapsed > limit:
                return Overdue(what, self.last_step, elapsed, limit, bound)
        return None

    def frozen_peer(self, now: float | None = None) -> Overdue | None:
        """In a phase that has outlived the step bound: the phase, if a peer has given no sign of life for
        longer than that bound (or the store, twice running, no answer at all); asked every ``peer_check_s``."""
        now = self.clock() if now is None else now
        with self._lock:
            if self.liveness is None or self._phase is None:
                return None
            what, elapsed, limit = self._phase[0], now - self._since, self.bound.limit(self._recent)
            bound = f"{self.bound.describe(self._recent)} = {limit:.0f} s, with a peer silent as long"
        if elapsed <= limit or now - self._peer_checked < self.peer_check_s:
            return None
        self._peer_checked = now
        silent = self.liveness.silent(limit)
        self._store_silent = self._store_silent + 1 if silent is None else 0
        if silent or self._store_silent >= 2:
            return Overdue(what, self.last_step, elapsed, limit, bound)
        return None

    def start(self) -> None:
        if self._thread is None:
            if self.liveness is not None:
                self.liveness.beat()  # before the first step can hang: every rank has a stamp
            self._thread = threading.Thread(target=self._run, name="dsclip-watchdog", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * self.poll_s + 5)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self.liveness is not None:
                self.liveness.beat()
            found = self.overdue() or self.frozen_peer()
            if found is not None and not self._stop.is_set():
                self.on_hang(found)  # ends the process (dsclip.train.hang); returning ends the watch
                return


class Liveness:
    """This rank's sign of life in the job's store, and who else has stopped giving one.

    ``store``: a store of its own for this thread (a clone of the default group's, with a short timeout:
    the process that hosts it, rank 0 under deepspeed/srun, may be the frozen one). Stamps are wall-clock
    times, compared across hosts: a frozen rank's stamp is as old as the hang (minutes), far beyond any
    clock skew between nodes."""

    PREFIX = "dsclip/alive/"

    def __init__(self, store, rank: int, world_size: int, *, wall: Callable[[], float] = time.time):
        self.store, self.rank, self.world_size, self.wall = store, rank, world_size, wall
        self._broken = False

    def beat(self) -> None:
        if self._broken:
            return
        try:
            # TCPStore's set sends and reads no reply: it returns at once even when the store's host is frozen
            self.store.set(f"{self.PREFIX}{self.rank}", f"{self.wall():.3f}")
        except Exception:  # the store's host is gone: silent() says so when it matters
            self._broken = True

    def silent(self, older_than_s: float, *, answer_s: float = 5.0) -> dict[int, float | None] | None:
        """The other ranks whose last stamp is older than ``older_than_s``: rank → its age in seconds (None: it
        never stamped); None when the store gives no answer within ``answer_s`` (the process that hosts it is
        then the likely frozen one)."""
        keys = [f"{self.PREFIX}{r}" for r in range(self.world_size)]
        answer: dict = {}

        def ask():
            present = [k for k in keys if self.store.check([k])]  # get() of a missing key waits out the timeout
            answer["stamps"] = dict(zip(present, self.store.multi_get(present))) if present else {}

        # A store whose host is frozen (SIGSTOP) never answers check() or get(), whatever the store's timeout
        # (measured, torch 2.14): ask from a thread of its own and give up on it. It stays blocked, a daemon,
        # in a process that is about to exit.
        asker = threading.Thread(target=_quietly, args=(ask,), name="dsclip-liveness", daemon=True)
        asker.start()
        asker.join(answer_s)
        if "stamps" not in answer:
            return None
        now, silent, stamps = self.wall(), {}, answer["stamps"]
        for r, key in enumerate(keys):
            if r == self.rank:
                continue
            age = now - float(stamps[key]) if key in stamps else None
            if age is None or age > older_than_s:
                silent[r] = age
        return silent


def _quietly(fn) -> None:
    try:
        fn()
    except Exception:  # no answer is an answer (see Liveness.silent)
        pass


def side_store(timeout_s: float = 5.0):
    """A clone of the default process group's store for another thread, with its own timeout (None without one).

    The store's Python object is not for concurrent use from two threads (torch's ``Store.clone`` docs: one
    clone per thread); the clone has its own connection, so the main thread's collectives never wait on it."""
    import torch.distributed as dist

    try:
        # private, read-only: torch has no public accessor for the default group's store
        store = dist.distributed_c10d._get_default_store().clone()
    except (AttributeError, RuntimeError, ValueError):
        return None
    store.set_timeout(timedelta(seconds=timeout_s))
    return store


# torch 2.14 reads the TORCH_FR_* names and, for compatibility, the older TORCH_NCCL_* ones: one set by the
# user under either name is left alone (first name: the one dsclip sets).
FLIGHT_RECORDER_VARS = (
    (("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"), "2000"),  # entries kept per rank
    (("TORCH_NCCL_DUMP_ON_TIMEOUT",), "1"),  # the NCCL watchdog writes them when a collective times out
    (("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"), None),  # where: file prefix, rank appended
)
FLIGHT_RECORDER_DIR = "flight_recorder"


def flight_recorder_env(logs: str | Path, name: str | None, env=None, *, make_dir: bool = False) -> dict[str, str]:
    """Set torch's flight-recorder variables that are unset (under all their names); returns those set.

    Dumps go to ``LOGS/flight_recorder/NAME_rank_R`` (``rank_R`` when the run name is not decided yet: the
    clock's default name is settled after the process group exists, and torch reads the variables when the
    group is created). Must run before the process group. ``make_dir``: create the folder (NCCL writes the
    file without creating it; on gloo nothing is dumped, so a CPU run leaves no empty folder)."""
    env = os.environ if env is None else env
    prefix = Path(logs) / FLIGHT_RECORDER_DIR / (f"{name}_rank_" if name else "rank_")
    done = {}
    for names, value in FLIGHT_RECORDER_VARS:
        if any(env.get(n) for n in names):
            continue
        env[names[0]] = done[names[0]] = value if value is not None else str(prefix)
    if make_dir and "TORCH_FR_DUMP_TEMP_FILE" in done:
        prefix.parent.mkdir(parents=True, exist_ok=True)
    return done
