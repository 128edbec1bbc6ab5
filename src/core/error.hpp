// SPDX-License-Identifier: MIT
// Internal error type: every failure inside libdion is a dion::Error carrying a
// status and a message; the C entry points (src/api) turn it into a status code
// and the handle's last-error text. Nothing ever exits or aborts.
#pragma once
#include <cstdarg>
#include <cstdio>
#include <exception>
#include <string>

#include "dion.h"

namespace dion {

class Error : public std::exception {
 public:
  Error(dion_status_t status, std::string message) : status_(status), message_(std::move(message)) {}
  const char* what() const noexcept override { return message_.c_str(); }
  dion_status_t status() const noexcept { return status_; }

 private:
  dion_status_t status_;
  std::string message_;
};

std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

// Throws dion::Error(status, printf-formatted message).
[[noreturn]] void fail(dion_status_t status, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

#define DION_REQUIRE(cond, status, ...) \
  do {                                  \
    if (!(cond)) ::dion::fail((status), __VA_ARGS__); \
  } while (0)

}  // namespace dion
