"""bench/torch/t1.py's report renders the recorded runs: a render that fails on the GPU
machine costs a device call, so the last eager and compiled runs are rendered here."""
from __future__ import annotations

import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
RUNS = ["2026-12-07-t1-eager-budget-v18-h200.json", "2026-12-07-t1-compiled-v11a-h200.json",
        "2026-12-07-t1-compiled-v11b-h200.json"]


@pytest.fixture(scope="module")
def t1():
    sys.path.insert(0, str(ROOT / "bench/torch"))
    try:
        import t1 as module
    finally:
        sys.path.pop(0)
    return module


def _host_rows(text: str) -> dict[str, list[str]]:
    table = text[text.index("| method | forward host ms"):].split("\n\n")[0].splitlines()[2:]
    return {cells[0]: cells[1:] for cells in
            ([c.strip() for c in row.strip("|").split("|")] for row in table)}


@pytest.mark.parametrize("run", RUNS)
def test_each_recorded_run_renders_with_its_host_table(t1, run):
    results = json.loads((ROOT / "bench/results" / run).read_text())
    text = t1.render(results, "command")
    rows = _host_rows(text)
    assert set(rows) == {r["method"] for r in results if r.get("host")}
    base = "none" if "eager" in run else "compiled"
    assert rows[base][2] == "+0.0"  # over base: the baseline itself


def test_the_host_table_sets_a_forwards_growth_beside_its_miss(t1):
    """v18's 15 GiB plan: its forward ran 35.4 ms longer on the GPU than none's, and its
    step 28.2 ms longer than forecast (bench/results/2026-12-07-t1-eager-budget-v18-h200.md)."""
    results = json.loads((ROOT / "bench/results" / RUNS[0]).read_text())
    row = _host_rows(t1.render(results, "command"))["spillway-eager-budget:15GiB"]
    assert row[2:4] == ["+35.4", "+28.2"]
    assert _host_rows(t1.render(results, "command"))["ckpt-full"][3] == "-"  # no forecast
