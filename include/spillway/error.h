#pragma once
// Spillway's exception hierarchy.
//
// Every message starts with "[component] " so a user can tell which part of the
// engine refused: "[graph] node 12 (mm_3): field 'args[0]' refers to unknown
// node 99". Checks that guard invariants stay on in release builds.
//
// Thread-safety: exception objects are immutable after construction.

#include <stdexcept>
#include <string>
#include <string_view>

namespace spillway {

// Base class of every error Spillway throws on purpose.
class Error : public std::runtime_error {
 public:
  Error(std::string_view component, std::string_view message)
      : std::runtime_error("[" + std::string(component) + "] " + std::string(message)),
        component_(component) {}

  // The component named at the start of what().
  const std::string& component() const noexcept { return component_; }

 private:
  std::string component_;
};

// A graph (JSON or in memory) breaks the format or an invariant. The message
// names the node and the field.
class InvalidGraph : public Error {
 public:
  using Error::Error;
};

// A caller passed an option or argument outside its documented range (a budget
// of -1, a scope that matches nothing, an unknown mode).
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// A device or pinned-host allocation could not be satisfied, or a budget is
// exhausted. Nothing that existed before the failing call has changed.
class OutOfMemory : public Error {
 public:
  using Error::Error;
};

// A CUDA runtime call failed; the message names the call and CUDA's error text.
class CudaError : public Error {
 public:
  using Error::Error;
};

// An asynchronous copy failed. Raised at the next wait on the affected value,
// never silently.
class TransferError : public Error {
 public:
  using Error::Error;
};

// An operation was asked of an object in a state that does not allow it (a
// wait with no pending transfer, a reload of something never offloaded).
class StateError : public Error {
 public:
  using Error::Error;
};

}  // namespace spillway
