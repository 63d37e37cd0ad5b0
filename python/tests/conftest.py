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


# The eager suites run tiny models whose ops take microseconds: torch's intra-op threads
# only contend there (two pytest workers on CI's two cores, each with two threads). On
# that machine they took 232 s with the default threads and 51 s with one (2026-12-07).
# The Inductor suites compile and run larger kernels, and keep the default.
_ONE_THREAD_MODULES = ("test_eager", "test_eager_budget", "test_eager_adversarial",
                       "test_eager_arguments", "test_eager_host_bench")


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread_for_eager_suites(request):
    name = request.module.__name__.rpartition(".")[2]
    if name not in _ONE_THREAD_MODULES:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
