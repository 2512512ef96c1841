"""DeepSpeed log lines that say nothing to a dsclip user, dropped at their logger.

DeepSpeed warns "You are using ZeRO with an untested optimizer, proceed with caution" on every ZeRO run
whose optimizer is not one of its own classes, even when the config allows it
(``zero_allow_untested_optimizer``, which dsclip sets: the client optimizer is a deliberate choice, see
dsclip/engine/optim.py and docs/deepspeed-notes.md). Only that message is filtered; every other DeepSpeed
warning still reaches the log.
"""

from __future__ import annotations

import logging

DEEPSPEED_LOGGER = "DeepSpeed"  # deepspeed.utils.logging.logger
DROPPED = ("ZeRO with an untested optimizer",)


class _DropKnownNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not any(s in msg for s in DROPPED)


def install_log_filter() -> None:
    """Idempotent; works before ``import deepspeed`` (the logger is looked up by name)."""
    logger = logging.getLogger(DEEPSPEED_LOGGER)
    if not any(isinstance(f, _DropKnownNoise) for f in logger.filters):
        logger.addFilter(_DropKnownNoise())
