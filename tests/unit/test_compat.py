"""The OpenCLIP flag audit: every option of open_clip_train's own parser is either accepted by
`dsclip train` with OpenCLIP's meaning or classified in dsclip/compat.py, and README shows that table.

OpenCLIP's parser is built by running ``open_clip_train.params.parse_args`` with
``ArgumentParser.parse_args`` intercepted, so no training code runs and an option OpenCLIP adds in a
later release shows up here (and fails until it gets a row)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from unittest import mock

import pytest
from open_clip_train import params as oc_params

from dsclip import compat
from dsclip.config import ConfigError, _field_index, build_arg_parser, parse_run_config

ROOT = Path(__file__).resolve().parents[2]


class _Captured(Exception):
    def __init__(self, parser):
        self.parser = parser


def _openclip_parser() -> argparse.ArgumentParser:
    def capture(self, args=None, namespace=None):
        raise _Captured(self)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", capture):
        try:
            oc_params.parse_args([])
        except _Captured as c:
            return c.parser
    raise AssertionError("open_clip_train.params.parse_args did not build a parser")


OC = _openclip_parser()
OC_OPTIONS = {a.option_strings[0]: a for a in OC._actions if a.option_strings and a.option_strings[0] != "-h"}
DS = build_arg_parser()
FIELDS = _field_index()


def _oc_default(action: argparse.Action):
    if action.default is None and action.dest in ("lr", "beta1", "beta2", "eps"):
        # OpenCLIP fills these after parsing from the model family; dsclip's towers are ViTs
        return oc_params.get_default_params("ViT-B-32")[action.dest]
    return action.default


def _norm(v):
    if v in ("", None):
        return None
    if isinstance(v, str) and v.endswith("/") and len(v) > 1:
        return v.rstrip("/")  # './logs/' and './logs' are the same folder
    return v


def _ds_default(flag: str):
    f = FIELDS[DS._option_string_actions[flag].dest][1]
    return f.default_factory() if f.default_factory is not None and callable(f.default_factory) else f.default


def test_openclip_parser_is_the_one_audited():
    # the count in README's summary comes from this parser; a smaller number means it was not read
    assert len(OC_OPTIONS) >= 90


def test_every_openclip_option_has_exactly_one_row():
    missing = sorted(set(OC_OPTIONS) - set(compat.OPENCLIP_FLAGS))
    assert not missing, f"OpenCLIP options not classified in dsclip/compat.py: {missing}"
    stale = sorted(set(compat.OPENCLIP_FLAGS) - set(OC_OPTIONS))
    assert not stale, f"dsclip/compat.py rows for options OpenCLIP does not have: {stale}"
    for flag, row in compat.OPENCLIP_FLAGS.items():
        assert row.status in compat.STATUSES, (flag, row.status)
        if row.status != "same":
            assert row.note, f"{flag}: a '{row.status}' row needs a note saying why and what to use instead"


@pytest.mark.parametrize("flag", sorted(compat.OPENCLIP_FLAGS))
def test_row_status_matches_what_dsclip_train_accepts(flag):
    row, oc = compat.OPENCLIP_FLAGS[flag], OC_OPTIONS[flag]
    accepted = flag in DS._option_string_actions
    if row.status in compat.REJECTED:
        assert not accepted, f"{flag} is accepted by dsclip train but classified '{row.status}'"
        with pytest.raises(ConfigError, match=f"unknown flag {flag}"):
            parse_run_config([flag] if oc.nargs == 0 else [flag, "1"])
        if row.status == "renamed":  # the replacement named first in the note exists
            alt = re.search(r"`(--[a-z0-9-]+)", row.note)
            assert alt is None or alt.group(1) in DS._option_string_actions, row.note
        return
    assert accepted, f"{flag} is classified '{row.status}' but dsclip train rejects it"
    ds = DS._option_string_actions[flag]
    # OpenCLIP's kind of option: a switch stays a switch, a value stays a value
    assert (oc.nargs == 0) == isinstance(ds, argparse.BooleanOptionalAction), flag
    if row.status == "same":
        if oc.choices:
            assert set(oc.choices) <= set(ds.choices or ()), (flag, oc.choices, ds.choices)
        assert _norm(_oc_default(oc)) == _norm(_ds_default(flag)), (
            f"{flag}: OpenCLIP's default {_oc_default(oc)!r}, dsclip's {_ds_default(flag)!r}: classify it "
            "'differs' with a note, or use OpenCLIP's default"
        )
        # an OpenCLIP-typed value parses to the same value in dsclip
        if oc.nargs != 0 and oc.type in (int, float) and not oc.choices:
            text = "3" if oc.type is int else "0.5"
            cfg = parse_run_config(["--name", "t", flag, text])
            section = FIELDS[ds.dest][0]
            assert getattr(getattr(cfg, section), ds.dest) == oc.type(text), flag


def test_switches_parse_on_and_off():
    cfg = parse_run_config(
        ["--name", "t", "--log-local", "--debug", "--copy-codebase", "--skip-scheduler", "--save-most-recent"]
        + ["--ddp-static-graph"]
    )
    assert cfg.log.log_local and cfg.log.debug and cfg.log.copy_codebase
    assert cfg.optim.skip_scheduler and cfg.checkpoint.save_most_recent and cfg.train.ddp_static_graph
    assert not parse_run_config(["--name", "t", "--no-log-local"]).log.log_local


def test_readme_table_is_the_rendered_table():
    page = (ROOT / compat.DOCS_PAGE).read_text()
    assert compat.readme_block() in page, (
        f"{compat.DOCS_PAGE}'s OpenCLIP table is out of date: run `python -m dsclip.compat --write-docs`"
    )


def test_write_readme_replaces_only_the_table(tmp_path):
    p = tmp_path / "README.md"
    p.write_text(f"before\n{compat.README_BEGIN}\nold | table\n{compat.README_END}\nafter\n")
    assert compat.write_readme(p)
    assert p.read_text() == f"before\n{compat.readme_block()}\nafter\n"
    assert not compat.write_readme(p)
