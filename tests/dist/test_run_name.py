"""The default run name needs the clock: it is decided on rank 0 and broadcast, so ranks whose clocks
read different seconds (they start a second apart) still write into one run folder."""

from __future__ import annotations

import time

import pytest

from dsclip.testing.gloo_world import run_world

pytestmark = [pytest.mark.dist]
T0 = 1_700_000_000.0  # a fixed instant; rank r's clock reads T0 + 1.5 r seconds


def _rank_name(rank, world):
    from dsclip.config import make_run_config, settle_run_name

    cfg = make_run_config({"model": "tiny", "lr": 1e-3, "batch_size": 8})
    assert cfg.log.name is None  # building and validating the config stamps nothing
    return settle_run_name(cfg, now=T0 + 1.5 * rank).log.name


def test_ranks_with_different_clocks_agree_on_rank0s_default_name():
    from dsclip.config import default_run_name, make_run_config

    names = run_world(_rank_name, 3)
    cfg = make_run_config({"model": "tiny", "lr": 1e-3, "batch_size": 8})
    assert names == [default_run_name(cfg, time.localtime(T0))] * 3
    assert default_run_name(cfg, time.localtime(T0 + 1.5)) != names[0]  # the clocks really differ


def test_given_name_is_kept_without_a_process_group():
    from dsclip.config import make_run_config, settle_run_name

    cfg = make_run_config({"name": "mine"})
    assert settle_run_name(cfg, now=T0) is cfg
