// SPDX-License-Identifier: MIT
#include "log.hpp"

#include <unistd.h>

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "error.hpp"

namespace dion {

namespace {
std::once_flag g_once;
int g_level = kLogNone;
FILE* g_file = nullptr;
std::mutex g_mutex;

void init_logging() {
  const char* lv = std::getenv("DION_DEBUG");
  if (lv) {
    if (!strcasecmp(lv, "VERSION")) g_level = kLogVersion;
    else if (!strcasecmp(lv, "WARN")) g_level = kLogWarn;
    else if (!strcasecmp(lv, "INFO")) g_level = kLogInfo;
    else if (!strcasecmp(lv, "TRACE")) g_level = kLogTrace;
  }
  g_file = stderr;
  const char* path = std::getenv("DION_DEBUG_FILE");
  if (path && g_level > kLogNone) {
    FILE* f = std::fopen(path, "a");
    if (f) g_file = f;
  }
  if (g_level >= kLogVersion)
    std::fprintf(g_file, "libdion %d.%d.%d\n", DION_VERSION_MAJOR, DION_VERSION_MINOR, DION_VERSION_PATCH);
}
}  // namespace

int log_level() {
  std::call_once(g_once, init_logging);
  return g_level;
}

void log_message(LogLevel level, const char* subsys, const char* fmt, ...) {
  if (log_level() < level) return;
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  std::lock_guard<std::mutex> lock(g_mutex);
  std::fprintf(g_file, "libdion:%d %s %s\n", static_cast<int>(getpid()), subsys, buf);
  std::fflush(g_file);
}

namespace {
std::string vformat(const char* fmt, va_list ap) {
  va_list ap2;
  va_copy(ap2, ap);
  int n = std::vsnprintf(nullptr, 0, fmt, ap);
  std::string s(n > 0 ? static_cast<size_t>(n) : 0, '\0');
  if (n > 0) std::vsnprintf(&s[0], static_cast<size_t>(n) + 1, fmt, ap2);
  va_end(ap2);
  return s;
}
}  // namespace

std::string format(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::string s = vformat(fmt, ap);
  va_end(ap);
  return s;
}

void fail(dion_status_t status, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::string s = vformat(fmt, ap);
  va_end(ap);
  throw Error(status, std::move(s));
}

}  // namespace dion
