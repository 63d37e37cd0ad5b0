"""pytest tests this source tree's spillway package, never an installed copy.

pyproject.toml puts python/ ahead of site-packages on sys.path, so a copy that
`pip install .` left there is not imported. An editable install (of this or
another checkout) can still win: its import hook sits in front of every
sys.path entry. Stop before the first test, naming what was found, rather than
test other code.
"""
from __future__ import annotations

import importlib.util
import pathlib

import pytest

IN_TREE = pathlib.Path(__file__).resolve().parents[1] / "spillway"


def pytest_configure(config):
    for name in ("spillway", "spillway._C"):
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            continue  # _C not built: the tests that need it say so
        found = pathlib.Path(spec.origin).resolve().parent
        if found != IN_TREE:
            raise pytest.UsageError(
                f"[tests] {name} resolves to {spec.origin}, not to this tree's {IN_TREE}: an "
                "installed copy shadows the package under test (`pip uninstall spillway` "
                "removes it)")
