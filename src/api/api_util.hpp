// SPDX-License-Identifier: MIT
// The exception firewall of every exported function: run the body, turn any
// dion::Error / bad_alloc / other exception into a status, and record the
// message as the handle's (or the calling thread's) last error.
#pragma once
#include <new>
#include <string>

#include "../core/error.hpp"
#include "../core/log.hpp"
#include "../core/optimizer.hpp"

namespace dion {

std::string& thread_last_error();

inline void record_error(Optimizer* opt, const std::string& msg) {
  if (opt) opt->last_error = msg;
  thread_last_error() = msg;
  DION_LOG_WARN("%s", msg.c_str());
}

template <class F>
dion_status_t api_call(Optimizer* opt, F&& body) {
  try {
    body();
    return DION_SUCCESS;
  } catch (const Error& e) {
    record_error(opt, e.what());
    return e.status();
  } catch (const std::bad_alloc&) {
    record_error(opt, "out of host memory");
    return DION_ERROR_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    record_error(opt, std::string("internal error: ") + e.what());
    return DION_ERROR_INTERNAL;
  } catch (...) {
    record_error(opt, "internal error: unknown exception");
    return DION_ERROR_INTERNAL;
  }
}

}  // namespace dion
