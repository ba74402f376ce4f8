// How the shim's C functions report C++ exceptions to Rust: run the body, catch what it
// throws, keep the message for the caller's *_last_error() and return non-zero.
#pragma once

#include <exception>
#include <string>

namespace manta {

// The last error on this thread (each C function's caller reads it right after a
// non-zero return).
inline std::string& last_error() {
  thread_local std::string message;
  return message;
}

template <typename F>
int guarded(F f) {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    last_error() = e.what();
  } catch (...) {
    last_error() = "unknown C++ exception";
  }
  return 1;
}

}  // namespace manta
