// CHECK for the standalone ctest programs: print the failed condition and exit non-zero.
#pragma once

#include <cstdio>
#include <cstdlib>

#define CHECK(cond)                                                                  \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      std::exit(1);                                                                  \
    }                                                                                \
  } while (0)
