"""The OpenCLIP flag audit: every option of open_clip_train's own parser is either accepted by
`dsclip train` with OpenCLIP's meaning or classified in dsclip/compat.py, and README shows that table.

OpenCLIP's parser is built by running ``open_clip_train.params.parse_args`` with
``ArgumentParser.parse_args`` intercepted, so no training code runs and an option OpenCLIP adds in a
later release shows up here (and fails until it gets a row). OpenCLIP main is not installable: its
options are dsclip/openclip_main_options.json (read from main's parser at the commit it names), and
every one of them needs a row too."""

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
MAIN = compat.main_flags()


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


def test_main_option_list_is_mains_parser_as_read():
    m = compat.main_options()
    assert re.fullmatch(r"[0-9a-f]{40}", m["commit"]) and m["path"] == "src/open_clip_train/params.py"
    assert len(MAIN) == len(m["options"]) == 139  # main's parser at that commit; no option listed twice
    names = [n for o in m["options"] for n in (o["flag"], *o["aliases"])]
    assert len(names) == len(set(names)) and "--visual-layer-decay" in names
    for flag, o in MAIN.items():
        assert o["kind"] in m["kinds"] and o["gist"], flag
        if flag in OC_OPTIONS:  # the transcription agrees with the installed 3.3.0 parser on the option's kind
            assert (OC_OPTIONS[flag].nargs == 0) == (o["kind"] in ("switch", "switch-off")), flag


def test_every_main_option_has_exactly_one_row():
    new = set(MAIN) - set(OC_OPTIONS)
    missing = sorted(new - set(compat.MAIN_FLAGS))
    assert not missing, f"OpenCLIP main options not classified in dsclip/compat.py MAIN_FLAGS: {missing}"
    stale = sorted(set(compat.MAIN_FLAGS) - new)
    assert not stale, f"MAIN_FLAGS rows for options main does not have, or 3.3.0 has too (use its row): {stale}"
    for flag, row in compat.MAIN_FLAGS.items():
        assert row.status in compat.STATUSES and row.note, (flag, row)
    table = compat.rows()
    assert [r[0] for r in table].count("--fsdp") == 1 and len(table) == len(set(MAIN) | set(OC_OPTIONS))
    versions = {flag: v for flag, _, v, _ in table}
    assert versions["--fsdp"] == "main" and versions["--horovod"] == "3.3.0" and versions["--lr"] == "3.3.0, main"


def test_main_changes_to_shared_options_are_noted():
    shared = set(MAIN) & set(OC_OPTIONS)
    assert set(compat.MAIN_CHANGES) <= shared
    for flag in sorted(shared):
        oc, o = OC_OPTIONS[flag], MAIN[flag]
        if _norm(oc.default) != _norm(o["default"]) or list(oc.choices or ()) != list(o["choices"] or ()):
            assert flag in compat.MAIN_CHANGES, f"{flag}: main changed its default or choices; say so in MAIN_CHANGES"
    # what the notes claim about dsclip
    with pytest.raises(ConfigError, match="--opt nadamw"):
        parse_run_config(["--name", "t", "--opt", "nadamw"])
    assert parse_run_config(["--name", "t", "--opt", "timm/nadamw"]).optim.opt == "timm/nadamw"
    with pytest.raises(ConfigError, match="--report-to 'trackio' is not supported"):
        parse_run_config(["--name", "t", "--report-to", "trackio"])
    assert "webdataset-audio" not in DS._option_string_actions["--dataset-type"].choices


@pytest.mark.parametrize("flag", sorted(compat.MAIN_FLAGS))
def test_main_row_status_matches_what_dsclip_train_accepts(flag):
    row, o = compat.MAIN_FLAGS[flag], MAIN[flag]
    names = [flag, *o["aliases"]]
    switch = o["kind"] in ("switch", "switch-off")
    if row.status in compat.REJECTED:
        for name in names:
            assert name not in DS._option_string_actions, f"{name} is accepted by dsclip train but '{row.status}'"
            with pytest.raises(ConfigError, match=f"unknown flag {name}: OpenCLIP's option, not offered"):
                parse_run_config([name] if switch else [name, "1"])
        return
    assert all(n in DS._option_string_actions for n in names), f"{names}: '{row.status}' but dsclip rejects one"
    ds = DS._option_string_actions[flag]
    assert all(DS._option_string_actions[n] is ds for n in names)  # an alias is the same option, as in main
    assert switch == isinstance(ds, argparse.BooleanOptionalAction), flag
    if row.status == "same":
        assert _norm(o["default"]) == _norm(_ds_default(flag)), (flag, o["default"], _ds_default(flag))
        assert set(o["choices"] or ()) <= set(ds.choices or ()), flag
        if o["kind"] == "value" and o["type"] in ("int", "float"):
            text = "3" if o["type"] == "int" else "0.5"
            for name in names:
                cfg = parse_run_config(["--name", "t", name, text])
                assert getattr(getattr(cfg, FIELDS[ds.dest][0]), ds.dest) == float(text), name


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
