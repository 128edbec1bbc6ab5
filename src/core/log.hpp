// SPDX-License-Identifier: MIT
// Logging switched by DION_DEBUG=WARN|INFO (default: silent) and redirected by
// DION_DEBUG_FILE=path. INFO checks the level before formatting.
#pragma once

namespace dion {

enum LogLevel { kLogNone = 0, kLogVersion = 1, kLogWarn = 2, kLogInfo = 3, kLogTrace = 4 };
int log_level();
void log_message(LogLevel level, const char* subsys, const char* fmt, ...) __attribute__((format(printf, 3, 4)));

#define DION_LOG_WARN(...) \
  do {                     \
    if (::dion::log_level() >= ::dion::kLogWarn) ::dion::log_message(::dion::kLogWarn, "WARN", __VA_ARGS__); \
  } while (0)
#define DION_LOG_INFO(subsys, ...) \
  do {                             \
    if (::dion::log_level() >= ::dion::kLogInfo) ::dion::log_message(::dion::kLogInfo, subsys, __VA_ARGS__); \
  } while (0)

}  // namespace dion
