"""`dsclip <command> --help` loads no torch, DeepSpeed, timm, torchvision nor webdataset (issue #33: it took
7-12 s because the run config's sections pulled the training stack in at import).

A bound on work, not a timed assertion: a fresh interpreter builds and prints each command's parser through
the real entry point and reports which heavy modules are in sys.modules afterwards.
"""

import json
import subprocess
import sys

HEAVY = ("torch", "deepspeed", "timm", "torchvision", "webdataset")
COMMANDS = (
    ["train"],
    ["eval"],
    ["convert"],
    ["data"],
    ["data", "write"],
    ["data", "inspect"],
    ["data", "index"],
    ["tokenizer"],
    ["tokenizer", "train"],
    ["plan"],
)

PROBE = """
import contextlib, io, json, sys
from dsclip.cli import main
from dsclip.config import build_arg_parser

heavy, commands = json.loads(sys.argv[1])
out = []
for argv in commands:
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        try:
            code = main([*argv, "--help"])
        except SystemExit as e:  # argparse's --help
            code = e.code
    out.append({"argv": argv, "code": code, "usage": text.getvalue().startswith("usage:"),
                "loaded": [m for m in heavy if m in sys.modules]})
build_arg_parser()  # the train parser on its own, as preflight and the tests build it
out.append({"argv": ["build_arg_parser"], "code": 0, "usage": True, "loaded": [m for m in heavy if m in sys.modules]})
print(json.dumps(out))
"""


def test_help_of_every_command_loads_no_training_stack():
    p = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps([HEAVY, COMMANDS])], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr
    results = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(results) == len(COMMANDS) + 1
    for r in results:  # cumulative: the first command that loads one of them is the one named
        assert r["code"] == 0 and r["usage"], r
        assert r["loaded"] == [], f"dsclip {' '.join(r['argv'])} --help imported {r['loaded']}"


def test_lazy_package_names_still_resolve():
    # The packages export their heavy names on first use (PEP 562); each one must still import.
    import dsclip.data
    import dsclip.eval
    import dsclip.losses
    import dsclip.model

    for pkg in (dsclip.data, dsclip.eval, dsclip.losses, dsclip.model):
        for name in pkg._LAZY:
            assert getattr(pkg, name) is not None, f"{pkg.__name__}.{name}"
        assert set(pkg.__all__) <= set(dir(pkg)) | set(pkg._LAZY), pkg.__name__
