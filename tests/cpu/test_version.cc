// One version number: the header's macros, the library's tpfuse::version() and CMake's
// project(VERSION) agree (tests/python/test_version.py checks the torch op and the package).
#include <gtest/gtest.h>

#include <string>

#include "tpfuse/version.h"

TEST(Version, LibraryHeaderAndProjectAgree) {
  EXPECT_EQ(std::string(tpfuse::version()), TPFUSE_VERSION_STRING);
  EXPECT_EQ(std::string(TPFUSE_VERSION_STRING), TPFUSE_PROJECT_VERSION);
  EXPECT_EQ(std::string(TPFUSE_VERSION_STRING), std::to_string(TPFUSE_VERSION_MAJOR) + "." +
                                                    std::to_string(TPFUSE_VERSION_MINOR) + "." +
                                                    std::to_string(TPFUSE_VERSION_PATCH));
}
