// The assertion of the C++ test executables: on failure, print where and abort
// (so sanitizer runs and ctest see a failure).
#pragma once

#include <cstdio>
#include <cstdlib>

#define CHECK(cond)                                                                 \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                 \
    }                                                                               \
  } while (0)
