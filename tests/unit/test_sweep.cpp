// Gradient records (include/powersgd/gradient_record.hpp) and `powersgd-bench
// sweep` run on one: the format round-trips and refuses damaged files; the sweep
// applies the reference's compression rule per rank and its error falls with r.
// powersgd-bench's refusals: one line, exit 1.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "support/doctest_main.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "powersgd/gradient_record.hpp"

namespace fs = std::filesystem;
using powersgd::GradientRecordWriter;
using powersgd::IoError;
using powersgd::Shape;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    std::string templ = (fs::temp_directory_path() / "psgd-sweep-XXXXXX").string();
    REQUIRE(::mkdtemp(templ.data()) != nullptr);
    path = templ;
  }
  ~TempDir() { fs::remove_all(path); }
};

const std::vector<std::vector<Shape>> kBuckets = {{{64, 32}, {48, 16}}, {{10}}};

// Gradients near rank 2 plus noise, with the same leading subspaces every step
// (as real gradients have, and warm start exploits): deterministic.
std::vector<std::vector<float>> make_step(std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::vector<float>> step(2);
  auto low_rank = [&](int n, int m) {
    std::mt19937 fixed(static_cast<unsigned>(n * 1000 + m));
    std::vector<float> a(size_t(n) * 2), b(size_t(m) * 2), out(size_t(n) * m);
    for (auto& v : a) v = normal(fixed);
    for (auto& v : b) v = normal(fixed) * (1.0f + 0.1f * normal(rng));
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < m; ++j)
        out[size_t(i) * m + j] = a[size_t(i) * 2] * b[size_t(j) * 2] + a[size_t(i) * 2 + 1] * b[size_t(j) * 2 + 1] +
                                 0.05f * normal(rng);
    return out;
  };
  auto t0 = low_rank(64, 32), t1 = low_rank(48, 16);
  step[0].insert(step[0].end(), t0.begin(), t0.end());
  step[0].insert(step[0].end(), t1.begin(), t1.end());
  for (int i = 0; i < 10; ++i) step[1].push_back(normal(rng));
  return step;
}

std::vector<std::vector<std::vector<float>>> write_record(const fs::path& path, int steps) {
  std::mt19937 rng(3);
  GradientRecordWriter out(path.string(), kBuckets);
  std::vector<std::vector<std::vector<float>>> written;
  for (int s = 0; s < steps; ++s) {
    auto step = make_step(rng);
    const float* data[2] = {step[0].data(), step[1].data()};
    out.append_step(data);
    written.push_back(std::move(step));
  }
  return written;
}

}  // namespace

TEST_CASE("gradient record: round trip of shapes and values") {
  TempDir dir;
  auto written = write_record(dir.path / "g.rec", 3);
  auto rec = powersgd::read_gradient_record((dir.path / "g.rec").string());
  CHECK(rec.buckets == kBuckets);
  CHECK(rec.bucket_sizes == std::vector<size_t>{64 * 32 + 48 * 16, 10});
  REQUIRE(rec.steps.size() == 3);
  CHECK(rec.steps == written);
}

TEST_CASE("gradient record: damaged files are refused with the reason") {
  TempDir dir;
  const fs::path good = dir.path / "g.rec";
  write_record(good, 2);
  auto bytes_of = [](const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  const std::string whole = bytes_of(good);
  auto refuses = [&](const std::string& content, const std::string& needle) {
    const fs::path p = dir.path / "bad.rec";
    std::ofstream(p, std::ios::binary | std::ios::trunc) << content;
    try {
      powersgd::read_gradient_record(p.string());
      FAIL("accepted a damaged record: ", needle);
    } catch (const IoError& e) {
      INFO(std::string(e.what()));
      CHECK(std::string(e.what()).find(needle) != std::string::npos);
    }
  };
  refuses("", "bad magic");
  refuses("PSGDGRAX" + whole.substr(8), "bad magic");
  refuses(whole.substr(0, 10), "truncated header");
  refuses(whole.substr(0, whole.size() - 3), "not a whole number");
  std::string version = whole;
  version[8] = 9;
  refuses(version, "version 9");
  CHECK_THROWS_AS(powersgd::read_gradient_record((dir.path / "missing.rec").string()), IoError);
}

TEST_CASE("sweep: reference compression rule per rank, error falls with the rank") {
  const char* bench = std::getenv("PSGD_BENCH");
  REQUIRE_MESSAGE(bench != nullptr, "PSGD_BENCH must name the powersgd-bench binary");
  TempDir dir;
  write_record(dir.path / "g.rec", 4);
  const fs::path json_path = dir.path / "sweep.json";
  std::string cmd = std::string(bench) + " sweep --gradients " + (dir.path / "g.rec").string() +
                    " --ranks 1,4,16 --json " + json_path.string() + " > " + (dir.path / "out.txt").string();
  REQUIRE(std::system(cmd.c_str()) == 0);
  std::ifstream in(json_path);
  auto doc = nlohmann::json::parse(in);
  REQUIRE(doc["ranks"].size() == 3);
  CHECK(doc["steps"] == 4);
  CHECK(doc["uncompressed_bytes_per_step"].get<double>() == 4.0 * (64 * 32 + 48 * 16 + 10));
  // min_compression_rate 2: 64x32 compressed while (64+32)*r*2 < 2048 (r <= 10),
  // 48x16 while (48+16)*r*2 < 768 (r <= 5); the 10-element vector never shrinks.
  auto bytes = [&](int i) { return doc["ranks"][i]["bytes_per_step"].get<double>(); };
  auto error = [&](int i) { return doc["ranks"][i]["relative_error"].get<double>(); };
  CHECK(bytes(0) == 4.0 * ((64 + 32) * 1 + (48 + 16) * 1 + 10));
  CHECK(bytes(1) == 4.0 * ((64 + 32) * 4 + (48 + 16) * 4 + 10));
  CHECK(bytes(2) == 4.0 * (64 * 32 + 48 * 16 + 10));
  // Near-rank-2 gradients: rank 1 misses a whole component, rank 4 only noise,
  // rank 16 sends everything uncompressed.
  CHECK(error(0) > 0.3);
  CHECK(error(1) < 0.1);
  CHECK(error(1) > 0.0);
  CHECK(error(2) == 0.0);
  CHECK(doc["ranks"][0]["tensor_relative_error"][2].get<double>() == 0.0);  // the vector is sent exactly
}

TEST_CASE("powersgd-bench: a bad argument or a library error is one line and exit 1, never an abort") {
  const char* bench = std::getenv("PSGD_BENCH");
  REQUIRE_MESSAGE(bench != nullptr, "PSGD_BENCH must name the powersgd-bench binary");
  TempDir dir;
  const fs::path shapes = dir.path / "m.shapes", out = dir.path / "out.txt";
  {
    std::ofstream s(shapes);
    s << "# comment\n   \r\nfc 16 8\n";  // a blank line of spaces and a CR is not a tensor
  }
  const auto run = [&](const std::string& arguments) {
    const std::string cmd =
        "env -u WORLD_SIZE " + std::string(bench) + " " + arguments + " > " + out.string() + " 2>&1";
    const int status = std::system(cmd.c_str());
    std::ifstream in(out);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    return std::pair{WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), text};
  };
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"engine --shapes " + shapes.string() + " --mode bogus",
       "powersgd-bench engine: --mode 'bogus': expected sync, async or fused\n"},
      {"engine --shapes " + (dir.path / "missing").string(),
       "powersgd-bench engine: cannot open shapes file " + (dir.path / "missing").string() + "\n"},
      {"engine --shapes " + shapes.string() + " --rank 0 --steps 1 --warmup 0",
       "powersgd-bench engine: "},
      {"sweep --gradients " + (dir.path / "missing").string(), "powersgd-bench sweep: "},
      {"sweep --gradients " + shapes.string() + " --ranks 0", "powersgd-bench sweep: "},
      {"engine --shapes " + shapes.string() + " --mode sync --stagger-ms 5",
       "powersgd-bench engine: --stagger-ms 5 with --mode 'sync': expected --mode async\n"},
      {"engine --shapes " + shapes.string() + " --channels 2 --mode fused",
       "powersgd-bench engine: --channels 2 with 1 bucket(s) (--bucket-mb 0): expected at most one channel per "
       "bucket\n"},
      {"allreduce --min-bytes 64 --max-bytes 8",
       "powersgd-bench allreduce: --min-bytes 64 above --max-bytes 8: expected at most --max-bytes\n"},
  };
  for (const auto& [arguments, expected] : cases) {
    CAPTURE(arguments);
    const auto [status, text] = run(arguments);
    INFO(text);
    CHECK(status == 1);
    CHECK(text.rfind(expected, 0) == 0);
    CHECK(std::count(text.begin(), text.end(), '\n') == 1);
  }
  // Counts the steps cannot be: CLI11's refusal (its exit status), not a division by zero.
  for (const std::string bad : {"--steps 0", "--warmup -2", "--bucket-mb -1", "--channels 0", "--stagger-ms -1"}) {
    CAPTURE(bad);
    const auto [status, text] = run("engine --shapes " + shapes.string() + " " + bad);
    INFO(text);
    CHECK(status != 0);
    CHECK(status < 128);
    CHECK(text.find("not in range") != std::string::npos);
  }
  // The blank line is no tensor: one tensor, 128 elements.
  const auto [status, text] = run("engine --shapes " + shapes.string() + " --steps 1 --warmup 0");
  INFO(text);
  CHECK(status == 0);
  CHECK(text.find("1 tensors, 128 elements") != std::string::npos);
}

TEST_CASE("powersgd-bench engine --channels: the model's buckets split over the channels, each counted once") {
  const char* bench = std::getenv("PSGD_BENCH");
  REQUIRE_MESSAGE(bench != nullptr, "PSGD_BENCH must name the powersgd-bench binary");
  TempDir dir;
  const fs::path shapes = dir.path / "m.shapes";
  {
    std::ofstream s(shapes);
    // Three buckets of at most 1 MiB (each tensor 0.5-0.75 MiB), compressed at rank 2, and a vector sent whole.
    s << "a 512 256\nb 384 512\nc 256 768\nbias 100\n";
  }
  const auto run = [&](const std::string& arguments) {
    const fs::path json = dir.path / "out.json";
    fs::remove(json);
    const std::string cmd = "env -u WORLD_SIZE " + std::string(bench) + " engine --shapes " + shapes.string() +
                            " --bucket-mb 1 --steps 2 --warmup 1 --json " + json.string() + " " + arguments +
                            " > " + (dir.path / "log").string() + " 2>&1";
    const int status = std::system(cmd.c_str());
    REQUIRE_MESSAGE(status == 0, cmd);
    std::ifstream in(json);
    return nlohmann::json::parse(in);
  };
  const nlohmann::json one = run("--channels 1");
  CHECK(one["buckets"].get<int>() == 3);
  CHECK(one["numel_before"].get<uint64_t>() == 2 * (512 * 256 + 384 * 512 + 256 * 768 + 100));  // 2 timed steps
  CHECK(one["current_rank"].size() == 3);
  for (const std::string arguments :
       {"--channels 2", "--channels 3 --mode fused", "--channels 2 --mode async --stagger-ms 1",
        "--channels 3 --mode async"}) {
    CAPTURE(arguments);
    const nlohmann::json split = run(arguments);
    CHECK(split["channels"].get<int>() == std::stoi(arguments.substr(arguments.find(' ') + 1)));
    CHECK(split["buckets"] == one["buckets"]);
    CHECK(split["elements"] == one["elements"]);
    // Every bucket compressed once, on its channel: the elements before and after, summed over the channels.
    CHECK(split["numel_before"] == one["numel_before"]);
    CHECK(split["numel_after"] == one["numel_after"]);
    CHECK(split["compression_rate"].get<double>() == doctest::Approx(one["compression_rate"].get<double>()));
    CHECK(split["compression_rate"].get<double>() > 1.0);
    CHECK(split["current_rank"] == one["current_rank"]);  // per bucket, in the model's order
  }
}

int main(int argc, char** argv) { return powersgd::testing::run_selected_tests(argc, argv); }
