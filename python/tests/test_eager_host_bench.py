"""bench/torch/eager_host_overhead.py runs on CPU as device-check runs it on CUDA (a
failure there costs a device call): every way, --ablate's two stubbed ways included."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_host_bench_ablate_rows(tmp_path):
    out = tmp_path / "host.json"
    subprocess.run([sys.executable, str(ROOT / "bench/torch/eager_host_overhead.py"),
                    "--layers", "2", "--steps", "2", "--ablate", "--json", str(out)],
                   check=True, capture_output=True, text=True,
                   env={"PYTHONPATH": str(ROOT / "python"), "PATH": "/usr/bin:/bin"})
    rows = {r["way"]: r for r in json.loads(out.read_text())["rows"]}
    keep = "plan, offload S_k, keep C_k and L_k (by position)"
    copies = rows[keep.replace(")", ", copies stubbed)")]
    pack = rows[keep.replace(")", ", pack stubbed)")]
    assert copies["tensors_seen"] == rows[keep]["tensors_seen"] > 0  # the same saves, no copy
    assert pack["tensors_seen"] == 0  # the stub counts nothing: no store ran
    assert all(r["forward_host_ms"] > 0 for r in rows.values())
    lean = rows[keep.replace(")", ", lean host)")]  # Note [A leaner host path]
    assert lean["tensors_seen"] == rows[keep]["tensors_seen"]
