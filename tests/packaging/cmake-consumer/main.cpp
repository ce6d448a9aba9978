// An embedder's program on the installed headers and library (C++ and C API):
// the library's version is the headers', and a world-of-1 reducer (RANK=0
// WORLD_SIZE=1) compresses one step. Prints "consumer: ..." on success.
#include <powersgd/comm.hpp>
#include <powersgd/powersgd.h>
#include <powersgd/reducer.hpp>
#include <powersgd/version.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

int main() {
  const std::string headers = std::to_string(PSGD_VERSION_MAJOR) + "." + std::to_string(PSGD_VERSION_MINOR) + "." +
                              std::to_string(PSGD_VERSION_PATCH);
  if (headers != psgd_version()) {
    std::fprintf(stderr, "consumer: headers %s, library %s\n", headers.c_str(), psgd_version());
    return 1;
  }
  try {
    auto comm = powersgd::Communicator::from_env();
    powersgd::Config config;
    config.rank = 1;
    config.start_iter = 0;
    powersgd::Reducer reducer(*comm, config);
    const int bucket = reducer.add_bucket({{64, 32}});
    std::vector<float> gradient(64 * 32);
    for (size_t i = 0; i < gradient.size(); ++i) gradient[i] = float((i * 7) % 13) / 13.0f - 0.5f;
    reducer.reduce(bucket, gradient.data());
    const powersgd::Stats stats = reducer.stats();
    for (float value : gradient) {
      if (!std::isfinite(value)) {
        std::fprintf(stderr, "consumer: a reduced value is not finite\n");
        return 1;
      }
    }
    if (stats.numel_after == 0 || stats.compression_rate() <= 1.0) {
      std::fprintf(stderr, "consumer: the step was not compressed (rate %g)\n", stats.compression_rate());
      return 1;
    }
    std::printf("consumer: powersgd %s, C++%ld, one step compressed %.1fx\n", psgd_version(), __cplusplus / 100 % 100,
                stats.compression_rate());
  } catch (const powersgd::Error& error) {
    std::fprintf(stderr, "consumer: %s\n", error.what());
    return 1;
  }
  return 0;
}
