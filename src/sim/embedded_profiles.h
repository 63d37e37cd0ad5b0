#pragma once
// Device profiles shipped with the project, compiled into spillway_sim from
// src/sim/profiles/*.json at build time (CMake generates the definitions from
// embedded_profiles.cc.in), so the JSON file is the one source of truth.
// Internal to spillway_sim.

#include <string_view>

namespace spillway::sim {

// The text of src/sim/profiles/nvidia-h200.json.
std::string_view nvidia_h200_profile_json();

}  // namespace spillway::sim
