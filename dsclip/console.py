"""dsclip's console lines, and the same lines in the run's log file (``RUN/out.log``).

Every line dsclip prints for the user goes through :func:`say`: written to the console (stdout, or stderr
for the world set-up's lines) and handed to the ``dsclip.console`` logger, to which train/runlog.py attaches
the run's log file. Lines said before the run folder exists (the checks before the process group, the rank
line, the tokenizer default) are kept here and written into the file first when it is attached, with their
own time stamps, so the log file holds the console's lines from the first one, in the console's order.

Plain Python (no torch): the checks before the process group say lines too.
"""

from __future__ import annotations

import logging
import sys

LOGGER = logging.getLogger("dsclip.console")
# A root console handler (a notebook's, a test's) must not print the lines a second time.
LOGGER.propagate = False
RUN_LOG = "_dsclip_run_log"  # attribute marking the handlers of a run's log file (train/runlog.py)
EARLY_LIMIT = 10_000  # records kept before the file exists (a run that never attaches one keeps no more)


class _Early(logging.Handler):
    """Keeps the records of ``dsclip.console`` until the run's log file is attached. (Not those of the
    ``dsclip`` logger: a handler there would keep its warnings from Python's last-resort stderr handler.)"""

    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.records) < EARLY_LIMIT:
            self.records.append(record)


_early = _Early()
_LOGGERS = (LOGGER, logging.getLogger("dsclip"))


def begin() -> None:
    """Start collecting a run's early lines: a new run in this process (tests, notebooks) drops the previous
    run's log file, so its lines before its own file exists are kept for its own file, not the last one's."""
    _early.records = []
    LOGGER.setLevel(logging.INFO)
    for lg in _LOGGERS:
        for old in [h for h in lg.handlers if getattr(h, RUN_LOG, False)]:
            lg.removeHandler(old)
            old.close()
    if _early not in LOGGER.handlers:
        LOGGER.addHandler(_early)


def take_early() -> list[logging.LogRecord]:
    """The records kept so far, in order; stops keeping (the run's log file takes over, or there is none)."""
    records, _early.records = _early.records, []
    LOGGER.removeHandler(_early)
    return records


def say(line: str, *, stream=None) -> None:
    """Print ``line`` (one write: the ranks of a node share a pipe) and log it for the run's log file."""
    out = sys.stdout if stream is None else stream
    out.write(line + "\n")
    out.flush()
    LOGGER.info(line)


begin()
