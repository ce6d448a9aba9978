// Every rank applies the same update, bit for bit, whatever its BLAS kernels and
// thread count (docs/compute.md, "Bitwise-identical updates"): ranks run with
// different OPENBLAS_CORETYPE, PSGD_BLAS_THREADS and PSGD_CPU_KERNELS (the fused
// kernels' vector width), every option of the engine,
// and compare a 64-bit hash of their outputs at every step.
//
//   powersgd-run -n 4 --timeout 120 -- test_determinism_mp
//
// powersgd-run gives every rank the same environment, and OpenBLAS reads its
// core type once, when it loads. So the process that powersgd-run starts (the
// driver) re-executes this binary, once per round, with its rank's own values:
// - rank 0's driver first probes the core types this machine's OpenBLAS accepts
//   and broadcasts the list: one child per name of OpenBLAS's x86-64
//   dynamic-arch table runs a few BLAS kernels and prints
//   openblas_get_corename(); a name counts when the child succeeds and reports
//   that same core (an unknown name falls back to another core, and some
//   cores' kernels need instructions this CPU lacks: SIGILL);
// - rank 0 always runs the core OpenBLAS picks for this host by itself (the
//   reference), the other ranks take the other accepted names in turn, one per
//   rank and round, until every name ran once; thread counts alternate 1 and 2
//   between ranks and rounds.
// Only the children see the changed variables; the test's own environment (and
// so any other test's) stays as it was. Without WORLD_SIZE the binary exits 77.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "support/doctest_main.hpp"

#include <cblas.h>
#include <spawn.h>
#include <strings.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "compute/backend.hpp"
#include "engine/fingerprint.hpp"
#include "powersgd/reducer.hpp"

extern char** environ;

using namespace powersgd;

namespace {

constexpr const char* kCorenameFlag = "--print-openblas-corename";

// OpenBLAS's x86-64 dynamic-arch core names (driver/others/dynamic.c), newest
// first, so that the first round pits the host's core against the newest others.
constexpr const char* kCoreNames[] = {
    "SapphireRapids", "Cooperlake", "SkylakeX", "Zen", "Excavator", "Steamroller", "Haswell", "Piledriver",
    "Bulldozer", "Sandybridge", "Bobcat", "Nano", "Barcelona", "Opteron_SSE3", "Opteron", "Nehalem",
    "Dunnington", "Penryn", "Core2", "Atom", "Prescott", "Athlon", "Banias", "Northwood", "Coppermine", "Katmai"};

// Runs the BLAS kernels that the CPU backend (sgemm) and LAPACK's QR (sgemv,
// sger, snrm2, sscal) use, small and large: some core types of the table use
// instructions this CPU lacks (FMA4 on AMD's Bulldozer family) and die here
// with SIGILL, which rules them out.
void exercise_blas() {
  for (int n : {4, 64, 200}) {
    std::vector<float> a(static_cast<size_t>(n * n), 0.5f), b(a), c(a), x(static_cast<size_t>(n), 0.25f), y(x);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, n, 4, n, 1.0f, a.data(), n, b.data(), 4, 0.0f, c.data(), 4);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, n, 4, 1.0f, a.data(), 4, b.data(), 4, 0.0f, c.data(), n);
    cblas_sgemv(CblasColMajor, CblasTrans, n, n, 1.0f, a.data(), n, x.data(), 1, 0.0f, y.data(), 1);
    cblas_sgemv(CblasColMajor, CblasNoTrans, n, n, 1.0f, a.data(), n, x.data(), 1, 0.0f, y.data(), 1);
    cblas_sger(CblasColMajor, n, n, -1.0f, x.data(), 1, y.data(), 1, a.data(), n);
    cblas_sscal(n, cblas_snrm2(n, x.data(), 1), y.data(), 1);
  }
}

// This process's environment with `changes` applied (nullopt: removed).
std::vector<std::string> environment_with(const std::map<std::string, std::optional<std::string>>& changes) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string item = *e;
    if (!changes.contains(item.substr(0, item.find('=')))) env.push_back(item);
  }
  for (const auto& [key, value] : changes)
    if (value) env.push_back(key + "=" + *value);
  return env;
}

// Runs this binary with `args` in `env` and waits for it. Returns its exit
// status (128 + signal when killed); its standard output goes to *out when given.
int run_self(const std::vector<std::string>& args, const std::vector<std::string>& env, std::string* out) {
  std::vector<std::string> argv_strings{"/proc/self/exe"};
  argv_strings.insert(argv_strings.end(), args.begin(), args.end());
  std::vector<char*> argv, envp;
  for (auto& a : argv_strings) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<std::string> env_copy = env;
  for (auto& e : env_copy) envp.push_back(e.data());
  envp.push_back(nullptr);
  int pipe_fds[2] = {-1, -1};
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (out != nullptr) {
    if (::pipe(pipe_fds) != 0) return -1;
    posix_spawn_file_actions_adddup2(&actions, pipe_fds[1], 1);
    posix_spawn_file_actions_addclose(&actions, pipe_fds[0]);
  }
  pid_t pid = -1;
  const int spawned = posix_spawn(&pid, "/proc/self/exe", &actions, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  if (out != nullptr) {
    ::close(pipe_fds[1]);
    if (spawned == 0) {
      char buf[256];
      ssize_t n;
      while ((n = ::read(pipe_fds[0], buf, sizeof buf)) > 0 || (n < 0 && errno == EINTR))
        if (n > 0) out->append(buf, static_cast<size_t>(n));
    }
    ::close(pipe_fds[0]);
  }
  if (spawned != 0) {
    std::fprintf(stderr, "test_determinism_mp: posix_spawn: %s\n", std::strerror(spawned));
    return -1;
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0)
    if (errno != EINTR) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// The core OpenBLAS runs with OPENBLAS_CORETYPE set to `coretype` (nullopt:
// unset, OpenBLAS's own choice for this host); "" when the child failed.
std::string corename_with(const std::optional<std::string>& coretype) {
  std::string out;
  if (run_self({kCorenameFlag}, environment_with({{"OPENBLAS_CORETYPE", coretype}, {"OPENBLAS_NUM_THREADS", "1"}}),
               &out) != 0)
    return "";
  while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
  return out;
}

int env_int(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr ? std::atoi(value) : -1;
}

std::unique_ptr<Communicator> connect(const std::string& run_id) {
  CommOptions o = CommOptions::from_env();
  o.run_id = run_id;
  return Communicator::create(o);
}

// Rank 0's probe of the core types: the host's own first, then the others this
// OpenBLAS accepts, separated by spaces; "" when the host's cannot be read.
std::string probe_cores() {
  std::string cores = corename_with(std::nullopt);
  if (cores.empty()) return "";
  for (const char* name : kCoreNames)
    if (strcasecmp(name, cores.c_str()) != 0 && strcasecmp(corename_with(name).c_str(), name) == 0)
      cores += std::string(" ") + name;
  return cores;
}

// The driver (see the top of the file). Returns the exit status of the test.
int drive(int argc, char** argv) {
  const int world = env_int("WORLD_SIZE"), rank = env_int("RANK");
  if (world < 1 || rank < 0 || rank >= world) {
    std::fprintf(stderr, "test_determinism_mp: WORLD_SIZE=%d, RANK=%d: expected 0 <= RANK < WORLD_SIZE\n", world, rank);
    return 1;
  }
  // Rank 0 probes, every rank gets its list (one probe instead of one per rank).
  char probed[1024] = {};
  {
    auto comm = connect("determinism-probe");
    if (rank == 0) std::snprintf(probed, sizeof probed, "%s", probe_cores().c_str());
    comm->broadcast(probed, sizeof probed, 0);
  }
  std::vector<std::string> cores;
  for (const char* p = probed; *p != '\0';) {
    const char* end = std::strchr(p, ' ');
    cores.emplace_back(p, end != nullptr ? end : p + std::strlen(p));
    p = end != nullptr ? end + 1 : p + std::strlen(p);
  }
  if (cores.empty()) {
    std::fprintf(stderr, "test_determinism_mp: rank 0 cannot read OpenBLAS's core name in a child process\n");
    return 1;
  }
  const std::string native = cores.front();
  const std::vector<std::string> others(cores.begin() + 1, cores.end());
  const size_t others_per_round = static_cast<size_t>(world - 1);
  const size_t rounds = others.empty() || world == 1 ? 1 : (others.size() + others_per_round - 1) / others_per_round;
  if (rank == 0) {
    std::string list;
    for (const auto& o : others) list += " " + o;
    std::fprintf(stderr, "test_determinism_mp: OpenBLAS picks %s here; it also accepts%s; %zu round(s)\n",
                 native.c_str(), list.empty() ? " nothing else" : list.c_str(), rounds);
  }
  const std::vector<std::string> args(argv + 1, argv + argc);
  for (size_t round = 0; round < rounds; ++round) {
    const std::string core = rank == 0 || others.empty()
                                 ? native
                                 : others[(round * others_per_round + static_cast<size_t>(rank - 1)) % others.size()];
    const std::string threads = std::to_string(1 + (round + static_cast<size_t>(rank)) % 2);
    // The fused kernels' vector width too: every variant this CPU runs, in turn.
    const std::vector<std::string> variants = compute::cpu_kernel_variants();
    const std::string kernels = variants[(round + static_cast<size_t>(rank)) % variants.size()];
    const int status = run_self(args, environment_with({{"OPENBLAS_CORETYPE", core},
                                                        {"PSGD_BLAS_THREADS", threads},
                                                        {"PSGD_CPU_KERNELS", kernels},
                                                        {"PSGD_DETERMINISM_ROUND", std::to_string(round)},
                                                        {"PSGD_DETERMINISM_ROUNDS", std::to_string(rounds)},
                                                        {"PSGD_DETERMINISM_CORE", core}}),
                                nullptr);
    if (status != 0) {
      std::fprintf(stderr, "test_determinism_mp: rank %d, round %zu (OPENBLAS_CORETYPE=%s, PSGD_BLAS_THREADS=%s, PSGD_CPU_KERNELS=%s) failed with status %d\n",
                   rank, round, core.c_str(), threads.c_str(), kernels.c_str(), status);
      return status > 0 && status < 126 ? status : 1;
    }
  }
  return 0;
}

struct Option {
  const char* name;
  Config config;
};

template <typename Edit>
Option option(const char* name, Edit edit) {
  Config c;
  c.start_iter = 1;
  c.rank = 4;  // Householder QR for P and Q
  edit(c);
  return {name, c};
}

std::vector<Option> options() {
  return {
      option("default (rank 1)", [](Config& c) { c.rank = 1; }),
      option("rank 4", [](Config&) {}),
      option("batch_same_shape, rank 4", [](Config& c) { c.batch_same_shape = true; }),
      option("whole_bucket, rank 1", [](Config& c) { c.whole_bucket = true; c.rank = 1; }),
      option("whole_bucket, rank 4", [](Config& c) { c.whole_bucket = true; }),
      option("adaptive, ranks 1..4, interval 1", [](Config& c) {
        c.adaptive = true;
        c.rank_low = 1;
        c.rank_high = 4;
        c.adaptive_interval = 1;
      }),
      option("alternating, rank 4", [](Config& c) { c.alternating = true; }),
      option("error_feedback off, rank 4", [](Config& c) { c.error_feedback = false; }),
  };
}

// Same-shaped tensors (batching), tensors left uncompressed, and enough
// elements that the whole-bucket square's P Q^T is a multi-threaded sgemm in
// OpenBLAS (m n k above its threshold of 262,144). One bucket: its two
// collectives per step are most of the test's time.
// {520, 509}: 2^18 floats and more, which the CPU kernels split over threads and write with non-temporal stores.
const std::vector<Shape> kShapes = {{96, 80}, {80}, {24, 16, 3, 3}, {24, 16, 3, 3}, {}, {40, 10}, {256, 288}, {256}, {520, 509}};
// Compressed steps 1 to 5. Adaptive, a decision after every step: step 1 (no
// previous window) selects rank_high, step 2 (same scale) rank_low, step 3
// (scaled up) rank_high again, step 4 rank_low.
constexpr int kSteps = 6;
float scale_at(int step) { return step >= 3 ? 16.0f : 1.0f; }

// Rank `rank`'s gradients at `step`: uniform in [-1, 1) from a splitmix64
// stream (cheap: the test's time should go to the engine).
std::vector<float> gradients(size_t n, int rank, int step) {
  uint64_t state = 0x9E3779B97F4A7C15ULL * (static_cast<uint64_t>(rank) * 1000 + static_cast<uint64_t>(step) + 1);
  std::vector<float> g(n);
  for (float& v : g) {
    uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z ^= z >> 31;
    v = static_cast<float>(static_cast<int32_t>(z >> 32)) * 0x1p-31f;
  }
  return g;
}

struct Output {
  uint64_t hash;
  uint32_t first;  // bits of the first element
  uint32_t rank;   // the compression rank of the next step
};

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && std::strcmp(argv[1], kCorenameFlag) == 0) {
    exercise_blas();
    std::printf("%s\n", openblas_get_corename());
    return 0;
  }
  if (std::getenv("WORLD_SIZE") == nullptr) {
    std::fprintf(stderr, "test_determinism_mp: WORLD_SIZE is not set; run under powersgd-run (skipped)\n");
    return 77;
  }
  if (std::getenv("PSGD_DETERMINISM_ROUND") == nullptr) return drive(argc, argv);
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // a killed driver takes its round with it
  return powersgd::testing::run_selected_tests(argc, argv);
}

namespace {

// This round's communicator, after checking that OpenBLAS runs the core this
// round assigned and that every rank runs the same round.
std::unique_ptr<Communicator> connect_round(const std::string& name) {
  const int round = env_int("PSGD_DETERMINISM_ROUND"), rounds = env_int("PSGD_DETERMINISM_ROUNDS");
  const char* core = std::getenv("PSGD_DETERMINISM_CORE");
  REQUIRE(core != nullptr);
  REQUIRE_MESSAGE(strcasecmp(openblas_get_corename(), core) == 0, "OPENBLAS_CORETYPE=", std::string(core),
                  " but OpenBLAS runs ", std::string(openblas_get_corename()));
  auto comm = connect(name + "-round-" + std::to_string(round));
  const int world = comm->size();
  // Every rank runs the same rounds (the probes agreed).
  const int mine[2] = {round, rounds};
  std::vector<int> rounds_of(2 * static_cast<size_t>(world));
  comm->allgather(mine, rounds_of.data(), sizeof mine);
  for (int w = 0; w < world; ++w) {
    CAPTURE(w);
    REQUIRE(rounds_of[2 * static_cast<size_t>(w)] == round);
    REQUIRE(rounds_of[2 * static_cast<size_t>(w) + 1] == rounds);
  }
  return comm;
}

size_t numel_of(const std::vector<Shape>& shapes) {
  size_t numel = 0;
  for (const Shape& shape : shapes) {
    size_t n = 1;
    for (int64_t d : shape) n *= static_cast<size_t>(d);
    numel += n;
  }
  return numel;
}

// Runs every option on one bucket of `shapes`, step s reducing inputs[s], and
// compares a hash of every rank's output at every step. Returns the failures
// (the same on every rank; rank 0's name the hashes).
std::vector<std::string> compare_options(Communicator& comm, const std::vector<Option>& opts,
                                         const std::vector<Shape>& shapes,
                                         const std::vector<std::vector<float>>& inputs) {
  const int round = env_int("PSGD_DETERMINISM_ROUND"), rounds = env_int("PSGD_DETERMINISM_ROUNDS");
  const int world = comm.size(), me = comm.rank();
  std::vector<std::string> failures;
  std::vector<std::string> labels;  // "rank 1 (SkylakeX, 2 BLAS threads)"
  for (const Option& opt : opts) {
    Reducer reducer(comm, opt.config);  // its backend applies PSGD_BLAS_THREADS
    if (labels.empty()) {
      char label[96] = {};
      std::snprintf(label, sizeof label, "%s, %d BLAS thread(s), %s kernels", openblas_get_corename(),
                    openblas_get_num_threads(), std::getenv("PSGD_CPU_KERNELS"));
      std::vector<char> all(sizeof label * static_cast<size_t>(world));
      comm.allgather(label, all.data(), sizeof label);
      for (int w = 0; w < world; ++w)
        labels.push_back("rank " + std::to_string(w) + " (" + std::string(all.data() + w * sizeof label) + ")");
      if (me == 0)
        for (const auto& l : labels) MESSAGE("round ", round + 1, " of ", rounds, ": ", l);
    }
    const int b = reducer.add_bucket(shapes);
    std::set<int> ranks_used;
    bool differed = false;
    for (size_t step = 0; step < inputs.size(); ++step) {
      ranks_used.insert(reducer.bucket_rank(b));
      std::vector<float> g = inputs[step];
      reducer.reduce(b, g.data());
      engine::Fnv hash;
      for (float v : g) hash.add(v);
      Output out{};
      out.first = std::bit_cast<uint32_t>(g[0]);
      out.rank = static_cast<uint32_t>(reducer.bucket_rank(b));
      out.hash = hash.value();
      std::vector<Output> all(static_cast<size_t>(world));
      comm.allgather(&out, all.data(), sizeof out);
      std::string differ;
      for (int w = 1; w < world; ++w)
        if (std::memcmp(&all[static_cast<size_t>(w)], &all[0], sizeof out) != 0) differ += " " + std::to_string(w);
      if (differ.empty()) continue;
      std::string hashes;  // rank 0 prints them, the others name the failure only
      for (int w = 0; w < world && me == 0; ++w) {
        const Output& o = all[static_cast<size_t>(w)];
        char line[96];
        std::snprintf(line, sizeof line, ": hash %016llx, first element %.10g, next rank %u",
                      static_cast<unsigned long long>(o.hash), static_cast<double>(std::bit_cast<float>(o.first)), o.rank);
        hashes += "\n  " + labels[static_cast<size_t>(w)] + line;
      }
      failures.push_back("option '" + std::string(opt.name) + "', step " + std::to_string(step) +
                         ": the outputs of rank(s)" + differ + " differ from rank 0's" + hashes);
      differed = true;
      break;  // every rank saw the same hashes: all leave this option together
    }
    if (opt.config.adaptive && !differed) CHECK(ranks_used == std::set<int>{1, 4});  // both levels ran
  }
  return failures;
}

}  // namespace

TEST_CASE("determinism: every option, every step, the same output bits on every rank") {
  auto comm = connect_round("determinism");
  // Every rank its own gradients, the same for every option.
  const size_t numel = numel_of(kShapes);
  std::vector<std::vector<float>> inputs;
  for (int step = 0; step < kSteps; ++step) {
    inputs.push_back(gradients(numel, comm->rank(), step));
    for (float& v : inputs.back()) v *= scale_at(step);
  }
  for (const auto& f : compare_options(*comm, options(), kShapes, inputs)) FAIL_CHECK(f);
}

// Degenerate factors (issue 29): the orthogonalization replaces a zero or
// dependent column by a vector drawn from (seed, bucket, step), the same bits
// on every rank. Step 0 plain; steps 1-3 a zero gradient on every rank (P and
// the warm Q are 0); steps 4-5 every rank a multiple of one rank-1 matrix per
// tensor (the summed P has rank 1: at rank 4, three dependent columns); steps
// 6-7 every rank its own gradients.
TEST_CASE("determinism: a zero, then rank-deficient, then full gradient: the same output bits on every rank") {
  auto comm = connect_round("determinism-degenerate");
  const std::vector<Shape> shapes = {{64, 48}, {64, 48}, {200, 130}, {7}};
  const size_t numel = numel_of(shapes);
  std::vector<std::vector<float>> inputs(8, std::vector<float>(numel, 0.0f));
  inputs[0] = gradients(numel, comm->rank(), 0);
  for (int step : {4, 5}) {
    size_t at = 0;
    const auto scale = static_cast<float>(1 + comm->rank() + step);
    for (const Shape& shape : shapes) {
      const auto rows = static_cast<size_t>(shape[0]);
      const size_t cols = shape.size() > 1 ? static_cast<size_t>(shape[1]) : 1;
      const std::vector<float> u = gradients(rows, 100, step), v = gradients(cols, 101, step);
      for (size_t i = 0; i < rows; ++i)
        for (size_t j = 0; j < cols; ++j) inputs[static_cast<size_t>(step)][at + i * cols + j] = scale * u[i] * v[j];
      at += rows * cols;
    }
  }
  for (int step : {6, 7}) inputs[static_cast<size_t>(step)] = gradients(numel, comm->rank(), step);
  const std::vector<Option> opts = {
      option("default (rank 1)", [](Config& c) { c.rank = 1; }),
      option("rank 2", [](Config& c) { c.rank = 2; }),
      option("rank 4", [](Config&) {}),
      option("batch_same_shape, rank 4", [](Config& c) { c.batch_same_shape = true; }),
      option("whole_bucket, rank 1", [](Config& c) { c.whole_bucket = true; c.rank = 1; }),
      option("whole_bucket, rank 4", [](Config& c) { c.whole_bucket = true; }),
      option("alternating, rank 1", [](Config& c) { c.alternating = true; c.rank = 1; }),
      option("alternating, rank 4", [](Config& c) { c.alternating = true; }),
      option("adaptive, ranks 1..4, interval 1", [](Config& c) {
        c.adaptive = true;
        c.rank_low = 1;
        c.rank_high = 4;
        c.adaptive_interval = 1;
      }),
      option("error_feedback off, rank 1", [](Config& c) { c.error_feedback = false; c.rank = 1; }),
      option("bf16 wire, rank 2", [](Config& c) { c.wire_dtype = WireDType::BFloat16; c.rank = 2; }),
      option("fp16 wire, alternating, rank 4", [](Config& c) {
        c.wire_dtype = WireDType::Float16;
        c.alternating = true;
      }),
  };
  for (const auto& f : compare_options(*comm, opts, shapes, inputs)) FAIL_CHECK(f);
}
