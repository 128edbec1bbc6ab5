// SPDX-License-Identifier: MIT
// ScopedEnv: an environment variable set (or unset) for a scope and put back
// as it was when the scope ends, also when an assertion leaves it early, so
// that one test's switch never reaches the next test, and a value the runner
// set for the whole suite (say DION_PHASED=0) is restored rather than erased.
// The library reads its DION_* switches when an optimizer or a backend is
// created, so a test creates them inside the scope. A failed setenv or
// unsetenv is a test failure.
#pragma once
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

class ScopedEnv {
 public:
  // value null: the variable is unset in the scope
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* was = std::getenv(name);
    had_ = was != nullptr;
    if (had_) before_ = was;
    set(value);
  }
  ~ScopedEnv() { set(had_ ? before_.c_str() : nullptr); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

  // Another value within the same scope (null: unset).
  void set(const char* value) {
    const int rc = value ? setenv(name_.c_str(), value, 1) : unsetenv(name_.c_str());
    if (rc != 0) ADD_FAILURE() << (value ? "setenv " : "unsetenv ") << name_ << " failed";
  }

 private:
  std::string name_, before_;
  bool had_ = false;
};
