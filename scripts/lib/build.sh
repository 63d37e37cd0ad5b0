# Sourced by scripts/run and scripts/test: a CMake build that says what it
# builds, about how long that takes, and how far it has got.
#
#   cmake_build TAG PRESET WHAT ESTIMATE [TARGET]
#     TAG       prefix of every line it prints: "run" gives "[run] ..."
#     PRESET    the configure and build preset (CMakePresets.json)
#     WHAT      what is being built, in a user's words
#     ESTIMATE  how long a clean build takes, e.g. "about 1 min on 2 cores"
#     TARGET    a ninja target (default: everything the preset builds)
#
# Configure output goes to a log that is shown only when configuring fails;
# CMake's warnings and errors (stderr) pass through. Ninja's progress is
# condensed to one line per tenth of the build (or per 15 s), with the elapsed
# seconds and the last file finished; compiler diagnostics pass through as they
# come. Returns the build's exit status.

cmake_build() {
  local tag=$1 preset=$2 what=$3 estimate=$4 target=${5:-}
  local start=$SECONDS status=0 log
  echo "[$tag] building $what ($preset preset): $estimate from clean, seconds when up to date"
  log="$(mktemp)"
  cmake --preset "$preset" >"$log" || status=$?
  if ((status != 0)); then
    cat "$log"
    rm -f "$log"
    echo "[$tag] cmake --preset $preset failed (exit $status)" >&2
    return "$status"
  fi
  rm -f "$log"
  echo "[$tag]   configured in $((SECONDS - start)) s"
  # shellcheck disable=SC2086  # $target: one or more target names, split on spaces
  NINJA_STATUS="[%f/%t] " cmake --build --preset "$preset" ${target:+--target $target} \
    -- -j"$(nproc)" 2>&1 | _cmake_build_progress "$tag" "$start" || status=$?
  if ((status != 0)); then
    echo "[$tag] building $what failed after $((SECONDS - start)) s (exit $status; the messages above say why)" >&2
    return "$status"
  fi
  echo "[$tag]   done in $((SECONDS - start)) s"
}

# Reads ninja's output on stdin; prints the condensed progress lines.
_cmake_build_progress() {
  local tag=$1 start=$2 line finished total what percent
  local printed_percent=-100 printed_at=$SECONDS
  while IFS= read -r line; do
    if [[ "$line" =~ ^\[([0-9]+)/([0-9]+)\]\ (.*)$ ]]; then
      finished=${BASH_REMATCH[1]} total=${BASH_REMATCH[2]} what=${BASH_REMATCH[3]}
      percent=$((100 * finished / total))
      if ((percent >= printed_percent + 10 || SECONDS - printed_at >= 15 || finished == total)); then
        # "Building CXX object src/ir/CMakeFiles/spillway_ir.dir/graph.cc.o" -> "src/ir/graph.cc"
        what=${what#Building CXX object }
        what=${what/CMakeFiles\/*.dir\//}
        what=${what%.o}
        [[ "$what" == Linking\ * ]] && what="linked ${what##* }"
        printf '[%s]   %3d%% %-*s %4d s  %s\n' "$tag" "$percent" $((2 * ${#total} + 3)) \
          "($finished/$total)" $((SECONDS - start)) "$what"
        printed_percent=$percent printed_at=$SECONDS
      fi
    elif [[ "$line" == "ninja: no work to do." ]]; then
      echo "[$tag]   nothing to rebuild"
    else
      printf '%s\n' "$line"  # a compiler's warning or error, ninja's FAILED: line
    fi
  done
}
