// The PowerSGD engine on the CUDA backend against the same engine on the CPU
// (world size 1, data in device memory): every option, the non-finite guard and
// a checkpoint written on one device and resumed on the other. Exits 77
// (Meson: skipped) when no CUDA device is usable.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "support/doctest_main.hpp"
#include <unistd.h>

#include <cstdio>
#include <string>

#include "compute/backend.hpp"
#include "engine_reference.hpp"

using namespace powersgd;
using powersgd::test::config_for;
using powersgd::test::gradients;
using powersgd::test::relative_difference;

namespace {

std::unique_ptr<Communicator> solo() { return Communicator::create(CommOptions::single_process()); }

// Reduces host vector g through device memory.
void reduce_on(compute::Backend& device, Reducer& r, int b, std::vector<float>& g) {
  compute::DeviceBuffer buffer = device.allocate(g.size());
  device.copy_from_host(buffer.data(), g.data(), g.size());
  r.reduce(b, buffer.data());
  device.copy_to_host(g.data(), buffer.data(), g.size());
}

const std::vector<Shape> kShapes = {{16, 20}, {}, {4, 3, 2, 2}, {16, 20}, {5}, {3, 40}, {64, 48}};

std::vector<double> as_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

}  // namespace

TEST_CASE("cuda engine: every option equals the CPU engine") {
  auto comm = solo();
  auto device = compute::make_cuda_backend(0);
  for (int rank : {1, 2, 4})
    for (int flags = 0; flags < 32; ++flags) {
      Config c = config_for(rank, flags);
      c.min_compression_rate = (flags & 16) ? 0.0 : 2.0;  // 0: 1-D (n x 1) and 0-D (1 x 1) tensors compressed
      CAPTURE(rank);
      CAPTURE(flags);
      Reducer cpu(*comm, c);
      Config g = c;
      g.device = Device::Cuda;
      Reducer gpu(*comm, g);
      cpu.add_bucket(kShapes);
      gpu.add_bucket(kShapes);
      const size_t n = cpu.bucket_size(0);
      for (int step = 0; step < 4; ++step) {
        auto a = gradients(n, 0, step), b = a;
        cpu.reduce(0, a.data());
        reduce_on(*device, gpu, 0, b);
        CHECK(relative_difference(b, as_double(a)) < 1e-4);
      }
      std::vector<float> ea(n), eb(n);
      cpu.error_feedback(0, ea.data());
      gpu.error_feedback(0, eb.data());
      CHECK(relative_difference(eb, as_double(ea)) < 1e-4);
    }
}

TEST_CASE("cuda engine: non-finite guard and a checkpoint moved between devices") {
  auto comm = solo();
  auto device = compute::make_cuda_backend(0);
  Config c;
  c.rank = 2;
  c.start_iter = 1;
  Config g = c;
  g.device = Device::Cuda;
  Reducer gpu(*comm, g);
  gpu.add_bucket(kShapes);
  const size_t n = gpu.bucket_size(0);
  for (int step = 0; step < 3; ++step) {
    auto x = gradients(n, 0, step);
    reduce_on(*device, gpu, 0, x);
  }
  auto bad = gradients(n, 0, 9);
  bad[n - 1] = std::nanf("");
  std::vector<float> before(n), after(n);
  gpu.error_feedback(0, before.data());
  CHECK_THROWS_AS(reduce_on(*device, gpu, 0, bad), NonFiniteError);
  gpu.error_feedback(0, after.data());
  CHECK(before == after);

  const std::string path = "/tmp/psgd-test-engine-cuda-" + std::to_string(::getpid());
  gpu.save(path);
  Reducer cpu(*comm, c);
  cpu.add_bucket(kShapes);
  cpu.load(path);
  CHECK(cpu.iteration() == gpu.iteration());
  for (int step = 4; step < 7; ++step) {
    auto a = gradients(n, 0, step), b = a;
    cpu.reduce(0, a.data());
    reduce_on(*device, gpu, 0, b);
    CHECK(relative_difference(b, as_double(a)) < 1e-4);
  }
  std::remove(path.c_str());
}

int main(int argc, char** argv) {
  if (const std::string reason = compute::cuda_unavailable_reason(); !reason.empty()) {
    std::printf("test_engine_cuda: skipping: %s\n", reason.c_str());
    return 77;
  }
  return powersgd::testing::run_selected_tests(argc, argv);
}
