// SPDX-License-Identifier: MIT
// API contract, debugging (dion.h preamble): DION_DEBUG=WARN makes the library
// log its errors, to DION_DEBUG_FILE when set; without DION_DEBUG it is silent.
// The library reads the environment once, so each case re-runs this
// executable as a child with the environment set.
#include <unistd.h>

#include <fstream>
#include <iterator>

#include "test_api_common.h"

using namespace dion_test;

namespace {

// The child: when DION_API_DEBUGLOG_CHILD is set, this binary makes two
// failing calls before main() and exits, so no test needs to be registered
// (and skipped) for it.
void child_make_errors() {
  dion_options_t o;
  dion_options_init(&o);
  o.backend = 42;
  dion_optimizer_t h = nullptr;
  int bad = dion_create(&h, &o) != DION_SUCCESS ? 0 : 1;
  o.backend = DION_BACKEND_HOST;
  if (dion_create(&h, &o) != DION_SUCCESS) _exit(3);
  dion_group_options_t g;
  dion_group_options_init(&g, DION_ALGO_MUON);
  g.lr = -3.0;
  bad += dion_add_group(h, &g, nullptr, 0, nullptr) != DION_SUCCESS ? 0 : 1;
  dion_destroy(h);
  _exit(bad);
}
[[maybe_unused]] const bool g_child = std::getenv("DION_API_DEBUGLOG_CHILD") ? (child_make_errors(), true) : false;

std::string run_child(const char* level, const std::string& file) {
  std::remove(file.c_str());
  char exe[4096];
  const ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n <= 0) return "(no /proc/self/exe)";
  exe[n] = '\0';
  std::string cmd;
  cmd += level ? std::string("env DION_DEBUG=") + level + " " : std::string("env -u DION_DEBUG ");
  cmd += "DION_API_DEBUGLOG_CHILD=1 DION_DEBUG_FILE='" + file + "' '" + exe + "' >/dev/null 2>&1";
  const int rc = std::system(cmd.c_str());
  EXPECT_EQ(rc, 0) << cmd;
  std::ifstream in(file);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::string temp_path(const char* tag) {
  const char* dir = std::getenv("TMPDIR");
  return std::string(dir ? dir : "/tmp") + "/dion_api_debuglog_" + tag + "_" + std::to_string(getpid()) + ".log";
}

TEST(ApiDebugLog, WarnLogsErrorsToTheFile) {
  const std::string file = temp_path("warn");
  const std::string log = run_child("WARN", file);
  std::remove(file.c_str());
  EXPECT_NE(log.find("dion_create"), std::string::npos) << "log:\n" << log;
  EXPECT_NE(log.find("backend"), std::string::npos) << "log:\n" << log;
  EXPECT_NE(log.find("dion_add_group"), std::string::npos) << "log:\n" << log;
  EXPECT_NE(log.find("lr"), std::string::npos) << "log:\n" << log;
}

TEST(ApiDebugLog, SilentWithoutDionDebug) {
  const std::string file = temp_path("off");
  const std::string log = run_child(nullptr, file);
  std::remove(file.c_str());
  EXPECT_EQ(log, "") << "the library logged without DION_DEBUG";
}

}  // namespace
