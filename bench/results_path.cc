#include "results_path.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "tpfuse/tpfuse.h"

namespace tpfuse::bench {

std::string results_stem(const std::string& device, int world_size, std::time_t when,
                         const std::string& commit) {
  std::tm utc{};
  gmtime_r(&when, &utc);
  char stamp[32];
  std::strftime(stamp, sizeof(stamp), "%Y%m%d-%H%M%S", &utc);
  return device + "-x" + std::to_string(world_size) + "-" + stamp + "-" + commit;
}

std::filesystem::path create_unique_file(const std::filesystem::path& wanted) {
  const std::filesystem::path parent = wanted.parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent);
  const std::string stem = wanted.stem().string();
  const std::string extension = wanted.extension().string();
  for (int suffix = 0; suffix < 10000; ++suffix) {
    const std::filesystem::path candidate =
        suffix == 0 ? wanted : parent / (stem + "-" + std::to_string(suffix) + extension);
    const int fd = ::open(candidate.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0644);
    if (fd >= 0) {
      ::close(fd);
      return candidate;
    }
    if (errno != EEXIST) {
      throw Error("tpfuse-bench: cannot create " + candidate.string() + ": " +
                  std::strerror(errno));
    }
  }
  throw Error("tpfuse-bench: no free name for " + wanted.string() + " (tried 10000 suffixes)");
}

}  // namespace tpfuse::bench
