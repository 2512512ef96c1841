"""#33: the venv's ninja leads PATH for DeepSpeed's JIT builds; DeepSpeed's 'untested optimizer' line is dropped."""

from __future__ import annotations

import logging
import os
import sys

from dsclip.cli import venv_ninja_first
from dsclip.engine.log_filter import install_log_filter


def test_venv_ninja_goes_first_on_path():
    bin_dir = os.path.dirname(sys.executable)
    assert os.access(os.path.join(bin_dir, "ninja"), os.X_OK)  # the venv has the ninja wheel (setup.py)
    env = {"PATH": os.pathsep.join(["/usr/bin", bin_dir, "/bin"])}
    assert venv_ninja_first(env) == bin_dir
    assert env["PATH"].split(os.pathsep) == [bin_dir, "/usr/bin", "/bin"]  # moved, not duplicated


def test_untested_optimizer_warning_dropped_other_warnings_kept(caplog):
    install_log_filter()
    install_log_filter()  # idempotent
    logger = logging.getLogger("DeepSpeed")
    with caplog.at_level(logging.WARNING, logger="DeepSpeed"):
        logger.warning("**** You are using ZeRO with an untested optimizer, proceed with caution *****")
        logger.warning("some other DeepSpeed warning")
    assert [r.getMessage() for r in caplog.records] == ["some other DeepSpeed warning"]


def test_the_partitioned_init_warning_is_not_printed_where_the_init_is_redone(caplog):
    # build_engine and the frozen teacher build under zero.Init and re-run the init (or load) right after,
    # so the model's "call model.init_weights(gather=...)" advice is noise there; elsewhere it stays
    from dsclip.engine.build import init_redone_after

    logger = logging.getLogger("dsclip.model.clip")
    with caplog.at_level(logging.WARNING, logger="dsclip.model.clip"):
        with init_redone_after():
            logger.warning("53 layers were partitioned (ZeRO-3 zero.Init) before the OpenCLIP init could run")
        logger.warning("outside")
    assert [r.getMessage() for r in caplog.records] == ["outside"]
