"""Imports flow one way: model/losses/data/eval never import DeepSpeed nor the trainer; nothing outside
tests/ imports tests/."""

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "dsclip"
PURE = ["model", "losses", "data", "eval"]
FORBIDDEN = ("deepspeed", "dsclip.engine", "dsclip.train", "dsclip.checkpoint", "dsclip.cli")


def imports(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
        elif isinstance(node, ast.ImportFrom) and node.level >= 2:
            yield "dsclip." + (node.module or "")  # `from ..engine import x` climbs out of the package


@pytest.mark.parametrize("package", PURE)
def test_pure_packages_do_not_import_deepspeed_or_trainer(package):
    offenders = [
        f"{path.relative_to(PKG.parent)} imports {name}"
        for path in sorted((PKG / package).rglob("*.py"))
        for name in imports(path)
        if name.startswith(FORBIDDEN)
    ]
    assert not offenders, offenders


def test_bench_and_the_package_import_nothing_from_tests():
    """bench/ and dsclip/ run without the test suite on the path: what both share lives in dsclip.testing."""
    root = PKG.parent
    offenders = [
        f"{path.relative_to(root)} imports {name}"
        for folder in ("bench", "dsclip")
        for path in sorted((root / folder).rglob("*.py"))
        for name in imports(path)
        if name == "tests" or name.startswith("tests.")
    ]
    assert not offenders, offenders
