"""How a user states a memory budget, shared by the eager and compiled paths.

    parse_memory_budget(12 << 30)   -> ("bytes", 12884901888)
    parse_memory_budget("12GiB")    -> ("bytes", 12884901888)
    parse_memory_budget("800 MiB")  -> ("bytes", 838860800)
    parse_memory_budget(0.6)        -> ("fraction", 0.6)   of the no-offload peak
    parse_memory_budget("60%")      -> ("fraction", 0.6)

Bytes count peak device memory as the caching allocator sees it, weights
included. Anything else is a ValueError that names the value.

    device_profile_json(None | path | dict, component) -> the simulator's
    device-profile JSON text ("" for the shipped H200 profile)
"""

from __future__ import annotations

import json
import math
import os
import re

_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z%]*)\s*$")


def parse_memory_budget(value: object, component: str = "budget", name: str = "memory_budget",
                        of: str = "the no-offload peak") -> tuple[str, float]:
    """("bytes", n) or ("fraction", f) for a budget; ValueError naming `value` otherwise,
    its message starting with "[component] name=value: " (`of`: what a fraction is of)."""
    def bad(why: str) -> ValueError:
        return ValueError(f"[{component}] {name}={value!r}: {why} (give bytes as an int, a "
                          f"string such as '12GiB' or '800MiB', or a fraction of {of} "
                          "in (0, 1] such as 0.6 or '60%')")

    if isinstance(value, bool):
        raise bad("a bool is not a budget")
    if isinstance(value, int):
        if value <= 0:
            raise bad("it must be > 0")
        return "bytes", value
    if isinstance(value, float):
        if not math.isfinite(value) or not 0 < value <= 1:
            raise bad(f"a float is a fraction of {of} and must be in (0, 1]")
        return "fraction", value
    if isinstance(value, str):
        match = _SIZE.match(value)
        if not match:
            raise bad("not a size")
        number, unit = float(match.group(1)), match.group(2).lower()
        if unit == "%":
            if not 0 < number <= 100:
                raise bad("a percentage must be in (0, 100]")
            return "fraction", number / 100
        if unit not in _UNITS:
            raise bad(f"unknown unit {match.group(2)!r}")
        size = number * _UNITS[unit]
        if size < 1:
            raise bad("it must be > 0")
        return "bytes", int(round(size))
    raise bad(f"a {type(value).__name__} is not a budget")


def budget_bytes(spec: tuple[str, float], no_offload_peak: int) -> int:
    """The budget in bytes, a fraction taken of `no_offload_peak`."""
    kind, number = spec
    if kind == "fraction":
        return max(1, int(number * no_offload_peak))
    return int(number)


def device_profile_json(device_profile, component: str) -> str:
    """The device-profile JSON text a planner binding takes: "" (the shipped H200 profile)
    for None, a file's text for a path, a dict as JSON; ValueError "[component] ..." else."""
    if device_profile is None:
        return ""
    if isinstance(device_profile, dict):
        return json.dumps(device_profile)
    if isinstance(device_profile, (str, os.PathLike)):
        try:
            with open(device_profile, encoding="utf-8") as f:
                return f.read()
        except OSError as e:
            raise ValueError(f"[{component}] device_profile: cannot read "
                             f"{str(device_profile)!r}: {e.strerror}") from None
    from spillway._device import shown
    raise ValueError(f"[{component}] device_profile must be a path to a device-profile JSON "
                     f"file or a dict, got {shown(device_profile)}")
