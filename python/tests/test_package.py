"""The package's public surface: spillway.offload_activations and spillway.compile.

Importing spillway is cheap: it does not import torch (nor the extension) until
an entry point is first used. Each check runs in a fresh interpreter, since
this test process has long imported torch.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

PYTHON_DIR = pathlib.Path(__file__).resolve().parents[1]


def _run(code: str) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PYTHON_DIR),
                                                      env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_importing_spillway_does_not_import_torch():
    assert _run("import sys, spillway, spillway.activations\n"
                "print(sorted(m for m in sys.modules if m == 'torch' or m == 'spillway._C'))"
                ) == "[]"


def test_public_entry_points_are_the_activation_paths():
    assert _run("import spillway\n"
                "from spillway.activations import compiled, eager\n"
                "print(spillway.offload_activations is eager.offload_activations,\n"
                "      spillway.compile is compiled.compile)") == "True True"


def test_the_weight_path_is_public_and_loads_lazily():
    assert _run("import sys, spillway, spillway.weights\n"
                "print(sorted(m for m in sys.modules if m == 'torch'))\n"
                "from spillway.weights import layerwise\n"
                "print(spillway.offload_weights is layerwise.offload_weights)") == "[]\nTrue"
