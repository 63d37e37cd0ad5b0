"""`python -m spillway.calibrate`: the device profile the simulator reads.

Without CUDA it stops with a clear error (checked on every machine by hiding
the GPUs); the profile it writes follows the device-profile format; on a GPU
a --quick run measures every field.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest
import torch

from spillway.calibrate import (CURVES, FORMAT, LINK_SIZES, QUICK_LINK_SIZES, check_profile, dumps,
                                save)
from spillway.calibrate.__main__ import main

REPO = pathlib.Path(__file__).resolve().parents[2]
PYTHON = REPO / "python"

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (torch.cuda.is_available() is False)")


def _sample() -> dict:
    curve = [{"bytes": 65536, "gbs": 20.5}, {"bytes": 268435456, "gbs": 55.0}]
    return {"format": FORMAT, "version": 1, "name": "Some GPU", "source": "a test",
            "memory_bytes": 1 << 34, "matmul_tflops_bf16": 700.0, "matmul_tflops_fp32": 50.0,
            "attention_tflops_bf16": 330.0, "attention_backward_tflops_bf16": 290.0,
            "memory_gbs": 4000.0, "launch_us": 2.5, "allocation_granularity": 512,
            **{c: [dict(p) for p in curve] for c in CURVES}}


def test_without_cuda_it_exits_with_a_clear_error(tmp_path):
    out = tmp_path / "profile.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": f"{PYTHON}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run = subprocess.run([sys.executable, "-m", "spillway.calibrate", "--quick", "--out", str(out)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 2
    assert run.stderr.startswith("[calibrate] needs a CUDA device, and torch.cuda.is_available() is False")
    assert not out.exists()


def test_the_profile_is_written_as_the_cpp_writer_writes_it(tmp_path):
    profile = _sample()
    save(profile, tmp_path / "p.json")
    text = (tmp_path / "p.json").read_text()
    assert json.loads(text) == profile
    assert list(json.loads(text)) == [
        "format", "version", "name", "source", "memory_bytes", "matmul_tflops_bf16",
        "matmul_tflops_fp32", "attention_tflops_bf16", "attention_backward_tflops_bf16",
        "memory_gbs", "launch_us", "allocation_granularity", "d2h", "h2d", "d2h_duplex",
        "h2d_duplex"]
    shipped = REPO / "src" / "sim" / "profiles" / "nvidia-h200.json"
    if shipped.exists():  # the simulator's own profile passes the same checks, field for field
        reference = json.loads(shipped.read_text())
        check_profile(reference)
        assert list(reference) == list(json.loads(dumps(reference)))
        assert set(reference) == set(profile)


@pytest.mark.parametrize("edit, message", [
    (lambda p: p.pop("h2d_duplex"), "field 'h2d_duplex' is missing"),
    (lambda p: p.update(extra=1), "field 'extra' is not a field of a device profile"),
    (lambda p: p.update(format="other"), "field 'format': expected 'spillway.device_profile'"),
    (lambda p: p["d2h"].reverse(), r"field 'd2h\[1\].bytes': points must be sorted"),
    (lambda p: p["h2d"][0].update(gbs=0), r"field 'h2d\[0\].gbs': expected a positive number"),
    (lambda p: p.update(memory_bytes=1.5), "field 'memory_bytes': expected a non-negative integer"),
    (lambda p: p.update(launch_us=float("nan")), "field 'launch_us'"),
])
def test_profiles_the_cpp_parser_would_reject_are_not_written(edit, message, tmp_path):
    profile = _sample()
    edit(profile)
    with pytest.raises(ValueError, match=message):
        save(profile, tmp_path / "p.json")
    assert not (tmp_path / "p.json").exists()


def test_the_full_run_measures_the_sizes_the_simulator_needs():
    KiB, MiB = 1 << 10, 1 << 20
    assert LINK_SIZES == (64 * KiB, 256 * KiB, MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB)
    assert set(QUICK_LINK_SIZES) < set(LINK_SIZES)


@needs_cuda
def test_cuda_quick_calibration_measures_every_field(tmp_path, capsys):
    out = tmp_path / "profile.json"
    start = time.monotonic()
    assert main(["--quick", "--out", str(out)]) == 0
    elapsed = time.monotonic() - start
    assert elapsed < 60
    profile = json.loads(out.read_text())
    check_profile(profile)
    device = torch.cuda.current_device()
    assert profile["name"] == torch.cuda.get_device_name(device)
    assert profile["memory_bytes"] == torch.cuda.get_device_properties(device).total_memory
    assert profile["allocation_granularity"] == 512
    for curve in CURVES:
        assert [p["bytes"] for p in profile[curve]] == list(QUICK_LINK_SIZES)
        assert all(0.1 < p["gbs"] < 1000 for p in profile[curve]), profile[curve]
    # Larger copies amortize their fixed cost: the largest size is not slower than the smallest.
    assert profile["d2h"][-1]["gbs"] > 0.9 * profile["d2h"][0]["gbs"]
    assert profile["matmul_tflops_bf16"] > profile["matmul_tflops_fp32"] > 0
    assert profile["memory_gbs"] > 100
    assert 0 < profile["launch_us"] < 100
    assert "spillway.calibrate --quick" in profile["source"]
    printed = capsys.readouterr().out
    assert f"{out}: {profile['name']} in " in printed
