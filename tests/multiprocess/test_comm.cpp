// Multi-process tests of the Gloo communicator. Every rank runs this binary
// with one test case selected, under powersgd-run (or any launcher that sets
// RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1 and MASTER_PORT):
//   powersgd-run -n 4 --timeout 120 -- test_comm -tc='allreduce*'
// Without WORLD_SIZE in the environment the binary exits 77 (skipped).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "support/doctest_main.hpp"
#include "support/scoped_env.hpp"
#include <signal.h>
#include <sys/wait.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <netinet/in.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <functional>
#include <iterator>
#include <optional>
#include <string>
#include <ctime>
#include <thread>
#include <tuple>
#include <vector>

#include "comm/communicator.hpp"
#include "comm/dtype.hpp"
#include "comm/host_stage.hpp"
#include "comm/peer_attribution.hpp"
#include "common/fd.hpp"
#include "store/store.hpp"
#include <gloo/types.h>

#include "powersgd_build_config.h"
#if PSGD_HAVE_IBVERBS
#include <infiniband/verbs.h>
#endif

using namespace powersgd;
using powersgd::transport::Algorithm;
using powersgd::transport::GlooApi;
using powersgd::transport::GlooCommunicator;
using powersgd::test::ScopedEnv;
using Clock = std::chrono::steady_clock;

namespace {

// Options from the environment, with a key prefix of the test's own.
CommOptions options(const char* run_id) {
  CommOptions o = CommOptions::from_env();
  o.run_id = run_id;
  return o;
}

int comm_world() { return std::atoi(std::getenv("WORLD_SIZE")); }

// With Gloo's legacy API no rank may close its pairs before every rank is done with its last collective: a rank
// that finished at once can close them while a peer still waits on it, and that peer fails with "Connection
// closed by peer" (seen under load, after FlushedBarrier and after halving-doubling). Counted on the launcher's
// store under `key` (one per use), not on Gloo's pairs.
void leave_together(const Communicator& comm, const char* key) {
  const CommOptions o = CommOptions::from_env();
  auto store = powersgd::transport::connect_tcp_store(o.store_addr, o.store_port, o.token, std::chrono::seconds(30));
  store->add(key, 1);
  const auto deadline = Clock::now() + std::chrono::seconds(30);
  while (store->add(key, 0) < comm.size() && Clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  CHECK(store->add(key, 0) == comm.size());
}

std::unique_ptr<GlooCommunicator> connect(const char* run_id, GlooApi api = GlooApi::New) {
  return GlooCommunicator::create(options(run_id), api);
}

// The MismatchError's message where creating the communicator must fail with one on this rank ("" and a failed
// check where it did not).
std::string creation_mismatch(const char* run_id) {
  try {
    connect(run_id);
  } catch (const MismatchError& e) {
    return e.what();
  }
  FAIL_CHECK("expected a MismatchError");
  return "";
}

// Integer-valued element i of rank r: sums over <= 5 ranks stay below 256, so
// they are exact even in bfloat16.
double value(int rank, size_t i) { return static_cast<double>((rank + 1) * static_cast<int>(i % 13 + 1)); }
double sum_value(int world, size_t i) { return static_cast<double>(world * (world + 1) / 2) * static_cast<double>(i % 13 + 1); }

struct Buffer {
  DataType type;
  std::vector<uint8_t> bytes;
  Buffer(DataType t, size_t count) : type(t), bytes(count * size_of(t)) {}
  size_t count() const { return bytes.size() / size_of(type); }
  void set(size_t i, double v) {
    switch (type) {
      case DataType::Float32:
        reinterpret_cast<float*>(bytes.data())[i] = static_cast<float>(v);
        return;
      case DataType::Float64:
        reinterpret_cast<double*>(bytes.data())[i] = v;
        return;
      case DataType::Float16:
        reinterpret_cast<gloo::float16*>(bytes.data())[i] = gloo::cpu_float2half_rn(static_cast<float>(v));
        return;
      case DataType::BFloat16:
        reinterpret_cast<uint16_t*>(bytes.data())[i] = transport::float_to_bfloat16(static_cast<float>(v));
        return;
    }
  }
  double get(size_t i) const {
    switch (type) {
      case DataType::Float32:
        return reinterpret_cast<const float*>(bytes.data())[i];
      case DataType::Float64:
        return reinterpret_cast<const double*>(bytes.data())[i];
      case DataType::Float16:
        return gloo::cpu_half2float(reinterpret_cast<const gloo::float16*>(bytes.data())[i]);
      case DataType::BFloat16:
        return transport::bfloat16_to_float(reinterpret_cast<const uint16_t*>(bytes.data())[i]);
    }
    return 0;
  }
};

// Sanitizers slow process exit (the victim's death) by up to a second or two.
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
constexpr std::chrono::milliseconds kSanitizerSlack{2000};
#else
constexpr std::chrono::milliseconds kSanitizerSlack{0};
#endif

// Index of the first element that differs from the expected sum, or count.
size_t first_wrong(const Buffer& b, int world) {
  for (size_t i = 0; i < b.count(); ++i)
    if (b.get(i) != sum_value(world, i)) return i;
  return b.count();
}

void check_allreduce(GlooCommunicator& comm, DataType type, size_t count, Algorithm algorithm) {
  Buffer b(type, count);
  for (size_t i = 0; i < count; ++i) b.set(i, value(comm.rank(), i));
  comm.allreduce_async(b.bytes.data(), count, type, algorithm).wait();
  INFO(to_string(type), " count ", count, " algorithm ", to_string(algorithm));
  CHECK(first_wrong(b, comm.size()) == count);
}

// Stops this process (SIGSTOP); a watchdog child continues it after `after`, once the survivors gave up, even
// if they crashed. Returns the child, to wait for.
pid_t stop_with_watchdog(std::chrono::milliseconds after) {
  const pid_t parent = getpid();
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    usleep(static_cast<useconds_t>(after.count()) * 1000);
    kill(parent, SIGCONT);
    _exit(0);
  }
  raise(SIGSTOP);
  return child;
}

const DataType kTypes[] = {DataType::Float32, DataType::Float64, DataType::Float16, DataType::BFloat16};
// 1 element, odd sizes, both sides of the default ring threshold, several MiB.
const size_t kCounts[] = {1, 7, 1000, 65537, 3 * 1024 * 1024 + 5};

}  // namespace

TEST_CASE("allreduce: every dtype and size, chosen algorithm") {
  auto comm = connect("allreduce-auto");
  for (DataType type : kTypes)
    for (size_t count : kCounts) {
      size_t bytes = count * size_of(type);
      const Algorithm small =
          bytes * static_cast<size_t>(comm->size() - 1) <= comm->direct_max_bytes() ? Algorithm::Direct
                                                                                      : Algorithm::ScatterGather;
      CHECK(comm->choose(bytes) == (bytes >= comm->options().ring_threshold_bytes ? Algorithm::Ring : small));
      check_allreduce(*comm, type, count, Algorithm::Auto);
    }
}

TEST_CASE("allreduce: ring and bcube and scatter-gather forced at every size") {
  auto comm = connect("allreduce-forced");
  for (Algorithm algorithm : {Algorithm::Ring, Algorithm::Bcube, Algorithm::ScatterGather})
    for (DataType type : {DataType::Float32, DataType::BFloat16})
      for (size_t count : kCounts) check_allreduce(*comm, type, count, algorithm);
}

// Gloo's sum of gloo::float16 skipped the store where the sum's bits equal the old value's bits converted as an
// integer: 2^-24 + 1 gave 2^-24 on every rank and every algorithm, the same wrong bits everywhere.
TEST_CASE("float16: sums are the correctly rounded sums, on every algorithm") {
  auto comm = connect("float16-sums");
  const int me = comm->rank();
  // Per element: rank 0's and rank 1's halves (the other ranks add +0) and the sum.
  struct Pair {
    uint16_t first, second, sum;
  };
  const Pair pairs[] = {
      {0x0001, 0x3C00, 0x3C00},  // 2^-24 + 1 = 1 (rounded)
      {0x3C00, 0x7380, 0x7380},  // 1 + 15360 = 15360 (rounded)
      {0x4000, 0x7400, 0x7400},  // 2 + 16384 = 16384 (rounded)
      {0x8000, 0x7800, 0x7800},  // -0 + 32768
      {0x3C00, 0x3C00, 0x4000},  // 1 + 1
      {0x7BFF, 0x7BFF, 0x7C00},  // 65504 + 65504 overflows to Inf
  };
  auto legacy = connect("float16-sums-legacy", GlooApi::Legacy);  // the old-style algorithms (ibverbs)
  const std::pair<GlooCommunicator*, Algorithm> runs[] = {
      {comm.get(), Algorithm::Auto},          {comm.get(), Algorithm::Direct},
      {comm.get(), Algorithm::ScatterGather}, {comm.get(), Algorithm::Ring},
      {comm.get(), Algorithm::Bcube},         {legacy.get(), Algorithm::Auto},
      {legacy.get(), Algorithm::Ring}};
  for (const auto& [c, algorithm] : runs) {
    CAPTURE(c == legacy.get());
    CAPTURE(static_cast<int>(algorithm));
    std::vector<uint16_t> x;
    for (const Pair& p : pairs) x.push_back(me == 0 ? p.first : me == 1 ? p.second : 0x0000);
    c->allreduce_async(x.data(), x.size(), DataType::Float16, algorithm).wait();
    for (size_t i = 0; i < x.size(); ++i) {
      CAPTURE(i);
      CHECK(x[i] == pairs[i].sum);
    }
  }
  leave_together(*comm, "float16-left");  // no rank closes its pairs while a peer is still in the last one
}

TEST_CASE("threshold: PSGD_RING_THRESHOLD_BYTES moves the switch") {
  setenv("PSGD_RING_THRESHOLD_BYTES", "4096", 1);
  setenv("PSGD_DIRECT_MAX_BYTES", "0", 1);  // below the ring threshold: scatter-gather
  auto comm = connect("threshold");
  setenv("PSGD_SCATTER_GATHER", "0", 1);  // below the ring threshold: bcube
  auto bcube = connect("threshold-bcube");
  unsetenv("PSGD_SCATTER_GATHER");
  unsetenv("PSGD_RING_THRESHOLD_BYTES");
  unsetenv("PSGD_DIRECT_MAX_BYTES");
  CHECK(comm->options().ring_threshold_bytes == 4096);
  CHECK(comm->choose(4095) == Algorithm::ScatterGather);
  CHECK(comm->choose(4096) == Algorithm::Ring);
  CHECK(bcube->choose(4095) == Algorithm::Bcube);
  CHECK(bcube->choose(4096) == Algorithm::Ring);
  for (GlooCommunicator* c : {comm.get(), bcube.get()}) {
    check_allreduce(*c, DataType::Float32, 1023, Algorithm::Auto);
    check_allreduce(*c, DataType::Float32, 1024, Algorithm::Auto);
  }
  // Sums in rank order: scatter-gather at any size; nothing where both rank-order algorithms are off.
  const bool one = comm->size() == 1;
  CHECK(comm->sums_in_rank_order(1023, DataType::Float32));
  CHECK(comm->sums_in_rank_order(1024, DataType::Float32) == one);  // the ring
  CHECK(bcube->sums_in_rank_order(1023, DataType::Float32) == one);
  CHECK(comm->choose_in_rank_order(1 << 20) == Algorithm::ScatterGather);
  CHECK(bcube->choose_in_rank_order(1) == Algorithm::Auto);
  if (bcube->size() > 1) {
    float x = 1;
    try {
      bcube->allreduce_in_rank_order_async(&x, 1, DataType::Float32).wait();
      FAIL("expected an UnsupportedError");
    } catch (const UnsupportedError& e) {
      CHECK(std::string(e.what()).find("neither the direct nor the scatter-gather") != std::string::npos);
    }
  }
}

TEST_CASE("direct: one round, the same bits on every rank, chosen below PSGD_DIRECT_MAX_BYTES") {
  setenv("PSGD_DIRECT_MAX_BYTES", "4096", 1);
  auto comm = connect("direct");
  unsetenv("PSGD_DIRECT_MAX_BYTES");
  const size_t others = static_cast<size_t>(comm->size() - 1);
  CHECK(comm->direct_max_bytes() == 4096);
  CHECK(comm->choose(4096 / others) == Algorithm::Direct);
  CHECK(comm->choose(4096 / others + 1) == Algorithm::ScatterGather);
  for (DataType type : kTypes)
    for (size_t count : kCounts) check_allreduce(*comm, type, count, Algorithm::Direct);
  // Sums that round: every rank gets the same bits (each adds the contributions in rank order).
  std::vector<float> x(1001);
  for (size_t i = 0; i < x.size(); ++i) x[i] = 1.0f / static_cast<float>(3 + i + 7 * static_cast<size_t>(comm->rank()));
  comm->allreduce_async(x.data(), x.size(), DataType::Float32, Algorithm::Direct).wait();
  std::vector<float> all(x.size() * static_cast<size_t>(comm->size()));
  comm->allgather(x.data(), all.data(), x.size() * sizeof(float));
  for (int r = 1; r < comm->size(); ++r)
    CHECK(std::memcmp(all.data(), all.data() + static_cast<size_t>(r) * x.size(), x.size() * sizeof(float)) == 0);
}

// The eager path (receives posted one direct collective ahead, PSGD_DIRECT_EAGER=1, the default) takes per-peer
// messages up to min(1 MiB, bound / (size - 1)); larger ones take Gloo's alltoall, and every other collective
// runs between them. The same bits as with the eager path off, in every order of sizes around the boundary.
TEST_CASE("direct: eager and not, mixed with larger messages and other collectives: the same bits") {
  setenv("PSGD_DIRECT_MAX_BYTES", "65536", 1);
  auto eager = connect("direct-eager");
  setenv("PSGD_DIRECT_EAGER", "0", 1);
  auto plain = connect("direct-not-eager");
  unsetenv("PSGD_DIRECT_EAGER");
  unsetenv("PSGD_DIRECT_MAX_BYTES");
  const int n = eager->size();
  if (n < 2) return;
  const size_t capacity = 65536 / static_cast<size_t>(n - 1) / 64 * 64 / sizeof(float);  // floats per peer posted ahead
  const size_t counts[] = {1, capacity, capacity + 1, 7, 3 * capacity, capacity - 1, capacity, 2};
  for (int pass = 0; pass < 3; ++pass)
    for (size_t count : counts) {
      CAPTURE(pass);
      CAPTURE(count);
      std::vector<float> x(count);  // sums that round
      for (size_t i = 0; i < count; ++i)
        x[i] = 1.0f / static_cast<float>(3 + i % 101 + 7 * static_cast<size_t>(eager->rank()) + static_cast<size_t>(pass));
      std::vector<float> y = x;
      eager->allreduce_async(x.data(), count, DataType::Float32, Algorithm::Direct).wait();
      plain->allreduce_async(y.data(), count, DataType::Float32, Algorithm::Direct).wait();
      CHECK(std::memcmp(x.data(), y.data(), count * sizeof(float)) == 0);
      // Collectives of other kinds between direct ones.
      if (count % 2 == 0) check_allreduce(*eager, DataType::Float64, count, Algorithm::Bcube);
      float root_value = static_cast<float>(eager->rank() + 1);
      eager->broadcast(&root_value, sizeof root_value, n - 1);
      CHECK(root_value == static_cast<float>(n));
    }
  // Counted per path: `counts` has 6 of 8 within the capacity, each run 3 times, and each of the 24 broadcasts
  // sends its shape in a lead exchange first ("Sizes agreed first"); none on `plain`.
  CHECK(eager->eager_direct_collectives() == 18 + 24);
  CHECK(plain->eager_direct_collectives() == 0);
  // Every rank has the same bits (each adds the contributions in rank order).
  std::vector<float> x(capacity);
  for (size_t i = 0; i < x.size(); ++i) x[i] = 1.0f / static_cast<float>(3 + i + 7 * static_cast<size_t>(eager->rank()));
  eager->allreduce_async(x.data(), x.size(), DataType::Float32, Algorithm::Direct).wait();
  std::vector<float> all(x.size() * static_cast<size_t>(n));
  eager->allgather(x.data(), all.data(), x.size() * sizeof(float));
  for (int r = 1; r < n; ++r)
    CHECK(std::memcmp(all.data(), all.data() + static_cast<size_t>(r) * x.size(), x.size() * sizeof(float)) == 0);
  // Eager on one rank and off on another: named at creation.
  if (eager->rank() == n - 1) setenv("PSGD_DIRECT_EAGER", "0", 1);
  {
    const std::string what = creation_mismatch("direct-eager-mismatch");
    INFO(what);
    CHECK(what.find("rank " + std::to_string(n - 1) + " has PSGD_DIRECT_EAGER 0 (rank 0: 1)") != std::string::npos);
  }
  unsetenv("PSGD_DIRECT_EAGER");
}

// Not in the tsan suite: the error crosses from the communication thread to the caller inside libstdc++'s
// uninstrumented exception_ptr, which TSan reports as a race on the exception's destruction.
TEST_CASE("direct: ranks that pass different counts get a MismatchError naming both; the group goes on") {
  auto eager = connect("direct-eager-count");
  const int n = eager->size();
  if (n < 2) return;
  std::vector<float> z(8, 1.0f);
  const size_t mine = eager->rank() == n - 1 ? 7 : 8;
  try {
    eager->allreduce_async(z.data(), mine, DataType::Float32, Algorithm::Direct).wait();
    FAIL("expected a MismatchError");
  } catch (const MismatchError& e) {
    const std::string what = e.what();
    INFO(what);
    CHECK(what.find(eager->rank() == n - 1 ? " sent 32 bytes where this rank" : " sent 28 bytes where this rank") !=
          std::string::npos);
  }
  CHECK(eager->eager_direct_collectives() == 1);
  eager->barrier();
  check_allreduce(*eager, DataType::Float32, 8, Algorithm::Direct);
}

// Float16 on every rank but the last, BFloat16 there: the same bytes, so only the header's type tells them
// apart (before, their bits were summed as one format). Every rank gets a MismatchError naming both types, no
// buffer changes, and the group goes on. Not in the tsan suite, as the case above.
namespace {
void check_types_refused(GlooCommunicator& comm, Algorithm algorithm, const char* name) {
  const int n = comm.size(), me = comm.rank();
  const bool odd = me == n - 1;
  const size_t count = 8 * static_cast<size_t>(n);
  const uint16_t one = odd ? 0x3F80 : 0x3C00;  // 1.0 in bfloat16, in float16
  std::vector<uint16_t> z(count, one);
  try {
    comm.allreduce_async(z.data(), count, odd ? DataType::BFloat16 : DataType::Float16, algorithm).wait();
    FAIL("expected a MismatchError");
  } catch (const MismatchError& e) {
    const std::string what = e.what();
    INFO(what);
    const std::string bytes = std::to_string(count * 2);
    CHECK(what.find(detail::concat(name, " allreduce: rank ", odd ? 0 : n - 1, " sent ", bytes, " bytes of ",
                                   odd ? "float16" : "bfloat16", " where this rank (", me, ") reduces ", bytes,
                                   " bytes of ", odd ? "bfloat16" : "float16")) != std::string::npos);
  }
  CHECK(std::count(z.begin(), z.end(), one) == static_cast<long>(count));
  comm.barrier();
  check_allreduce(comm, DataType::Float16, count, algorithm);
  check_allreduce(comm, DataType::BFloat16, count, algorithm);
}
}  // namespace

TEST_CASE("direct: ranks that pass float16 where another passes bfloat16 get a MismatchError naming both") {
  auto comm = connect("direct-eager-types");
  if (comm->size() < 2) return;
  check_types_refused(*comm, Algorithm::Direct, "direct");
}

TEST_CASE("scatter-gather: ranks that pass float16 where another passes bfloat16 get a MismatchError naming both") {
  auto comm = connect("scatter-gather-types");
  if (comm->size() < 2) return;
  check_types_refused(*comm, Algorithm::ScatterGather, "scatter-gather");
}

// Callers out of step: the last rank runs a lead exchange of as many bytes where the others run a direct
// allreduce. The lead exchange's header is marked, so each side names the other's message; nothing is summed
// and the group goes on. Not in the tsan suite, as the cases above.
TEST_CASE("direct: ranks that pass data where another passes a lead get a MismatchError naming it") {
  auto comm = connect("direct-eager-lead");
  const int n = comm->size(), me = comm->rank();
  if (n < 2) return;
  std::vector<float> z(8, 1.0f);
  std::vector<double> lead(4, 1.0), leads(4 * static_cast<size_t>(n));
  bool summed = true;
  try {
    if (me == n - 1)
      comm->lead_exchange_async(lead.data(), leads.data(), lead.size() * sizeof(double), nullptr, 0,
                                DataType::Float32, &summed)
          .wait();
    else
      comm->allreduce_async(z.data(), z.size(), DataType::Float32, Algorithm::Direct).wait();
    FAIL("expected a MismatchError");
  } catch (const MismatchError& e) {
    const std::string what = e.what();
    INFO(what);
    CHECK(what.find(me == n - 1 ? detail::concat("lead exchange: rank 0 sent a direct allreduce's 32 bytes of ",
                                                 "float32 where this rank (", me, ") sends a lead of 32 bytes")
                                : detail::concat("direct allreduce: rank ", n - 1,
                                                 " sent a lead exchange's lead (the engine's announce) where this "
                                                 "rank (", me,
                                                 ") reduces 32 bytes")) != std::string::npos);
  }
  CHECK(std::count(z.begin(), z.end(), 1.0f) == 8);
  comm->barrier();
  check_allreduce(*comm, DataType::Float32, 8, Algorithm::Direct);
}

// The lead exchange (Communicator::lead_exchange_async): every rank's lead arrives everywhere, and the data is
// summed with direct's bits exactly where every rank passed the same count and type within the capacity; else no
// rank's data changes, and every rank says so alike. One round each; the group goes on after each case.
// Staged (PSGD_HOST_STAGE=1), the same with staged allreduce's bits (direct among the leaders): the host's
// data summed in rank order, then the hosts'.
namespace {

void lead_exchange_cases(GlooCommunicator* comm, size_t capacity) {
  const int n = comm->size();
  const auto ranks = static_cast<size_t>(n);
  const int me = comm->rank();
  REQUIRE(comm->lead_exchange_capacity() == capacity);
  constexpr size_t kLead = 4;  // doubles
  std::vector<double> lead(kLead), leads(kLead * ranks);
  for (size_t v = 0; v < kLead; ++v) lead[v] = 1000.0 * me + static_cast<double>(v);
  const auto check_leads = [&] {
    for (size_t r = 0; r < ranks; ++r)
      for (size_t v = 0; v < kLead; ++v) CHECK(leads[r * kLead + v] == 1000.0 * static_cast<double>(r) + static_cast<double>(v));
  };
  const auto values = [&](size_t count, int salt) {
    std::vector<float> x(count);  // sums that round
    for (size_t i = 0; i < count; ++i) x[i] = 1.0f / static_cast<float>(3 + i % 89 + 11 * static_cast<size_t>(me) + static_cast<size_t>(salt));
    return x;
  };
  const size_t fits = (capacity - kLead * sizeof(double)) / sizeof(float);
  // count, whether every rank passes it alike (else the last rank passes `odd`), and the expected outcome.
  struct Case {
    size_t count;
    size_t odd;  // the last rank's count
    bool summed;
  };
  const Case cases[] = {{fits, fits, true},       {1, 1, true},   {1000, 1000, true}, {1000, 0, false},
                        {1000, 999, false},       {fits + 1, fits + 1, false},      {0, 0, false},
                        {fits, fits + 1, false},  {7, 7, true}};
  for (const Case& c : cases) {
    CAPTURE(c.count);
    CAPTURE(c.odd);
    const size_t count = me == n - 1 ? c.odd : c.count;
    std::vector<float> x = values(std::max<size_t>(count, 1), 0);
    const std::vector<float> before = x;
    std::fill(leads.begin(), leads.end(), -1.0);
    bool summed = !c.summed;
    const uint64_t rounds = comm->communication_rounds();
    comm->lead_exchange_async(lead.data(), leads.data(), kLead * sizeof(double), x.data(), count, DataType::Float32,
                              &summed)
        .wait();
    CHECK(comm->communication_rounds() - rounds == 1);
    CHECK(summed == c.summed);
    check_leads();
    if (!c.summed) {
      CHECK(std::memcmp(x.data(), before.data(), x.size() * sizeof(float)) == 0);
      continue;
    }
    std::vector<float> direct = before;
    comm->allreduce_async(direct.data(), count, DataType::Float32, Algorithm::Direct).wait();
    CHECK(std::memcmp(x.data(), direct.data(), count * sizeof(float)) == 0);
  }
  // Another type: summed in it (exact sums).
  std::vector<double> d(16, 1.0 + me);
  bool summed = false;
  comm->lead_exchange_async(lead.data(), leads.data(), kLead * sizeof(double), d.data(), d.size(), DataType::Float64,
                            &summed)
      .wait();
  CHECK(summed);
  CHECK(d[15] == static_cast<double>(ranks * (ranks + 1) / 2));
  // The 16-bit types, with sums that round: summed in the type, with the bits of the direct allreduce (staged:
  // of the staged one with direct among the leaders).
  for (DataType type : {DataType::Float16, DataType::BFloat16}) {
    CAPTURE(to_string(type));
    Buffer x(type, 200), direct(type, 200);
    for (size_t i = 0; i < x.count(); ++i) x.set(i, 1.0 / static_cast<double>(3 + i % 89 + 11 * static_cast<size_t>(me)));
    direct.bytes = x.bytes;
    summed = false;
    std::fill(leads.begin(), leads.end(), -1.0);
    comm->lead_exchange_async(lead.data(), leads.data(), kLead * sizeof(double), x.bytes.data(), x.count(), type,
                              &summed)
        .wait();
    CHECK(summed);
    check_leads();
    comm->allreduce_async(direct.bytes.data(), direct.count(), type, Algorithm::Direct).wait();
    CHECK(x.bytes == direct.bytes);
  }
  // The same bytes in another type on one rank: not summed.
  std::vector<uint8_t> raw(64, 0);
  comm->lead_exchange_async(lead.data(), leads.data(), kLead * sizeof(double), raw.data(), me == n - 1 ? 32 : 16,
                            me == n - 1 ? DataType::Float16 : DataType::Float32, &summed)
      .wait();
  CHECK(!summed);
  // Two parts (the engine's float32 values and its 16-bit factors in one exchange): each summed with the bits of
  // its own direct allreduce, both or neither; neither where the last rank's first or second part differs in
  // count or type (3 floats against 4 end at the same 8-byte boundary: the headers must still differ), or the
  // two do not fit beside the lead (the second part starts at a multiple of 8 bytes). A call of one part is a
  // call of two whose second is empty.
  {
    const size_t room = capacity - kLead * sizeof(double);
    const size_t most_halves = (room - 16) / 2;  // beside 3 floats (12 bytes, padded to 16)
    struct TwoParts {
      size_t floats, odd_floats;  // the last rank's first part
      size_t halves, odd_halves;  // and second part, of odd_type
      DataType odd_type;
      bool summed;
      bool odd_one_part = false;  // the last rank passes the first part alone
    };
    const TwoParts two_cases[] = {{3, 3, 5, 5, DataType::BFloat16, true},
                                  {3, 3, most_halves, most_halves, DataType::BFloat16, true},
                                  {3, 3, most_halves + 1, most_halves + 1, DataType::BFloat16, false},
                                  {3, 3, 5, 5, DataType::Float16, false},
                                  {3, 3, 5, 4, DataType::BFloat16, false},
                                  {3, 3, 5, 0, DataType::BFloat16, false},
                                  {4, 3, 5, 5, DataType::BFloat16, false},
                                  {3, 4, 5, 5, DataType::BFloat16, false},
                                  {0, 0, 6, 6, DataType::BFloat16, true},
                                  {3, 3, 0, 0, DataType::BFloat16, true, true}};
    for (const TwoParts& c : two_cases) {
      CAPTURE(c.floats);
      CAPTURE(c.odd_floats);
      CAPTURE(c.halves);
      CAPTURE(c.odd_halves);
      const bool odd = me == n - 1;
      const DataType type = odd ? c.odd_type : DataType::BFloat16;
      const size_t floats = odd ? c.odd_floats : c.floats, halves = odd ? c.odd_halves : c.halves;
      std::vector<float> x = values(std::max<size_t>(floats, 1), 1);
      Buffer h(type, std::max<size_t>(halves, 1));
      for (size_t i = 0; i < h.count(); ++i)
        h.set(i, 1.0 / static_cast<double>(5 + i % 37 + 7 * static_cast<size_t>(me)));
      const std::vector<float> x_before = x;
      const std::vector<uint8_t> h_before = h.bytes;
      const LeadPart parts[] = {{x.data(), floats, DataType::Float32}, {h.bytes.data(), halves, type}};
      const size_t passed = odd && c.odd_one_part ? 1 : 2;
      std::fill(leads.begin(), leads.end(), -1.0);
      summed = !c.summed;
      const uint64_t rounds = comm->communication_rounds();
      comm->lead_exchange_async(lead.data(), leads.data(), kLead * sizeof(double),
                                std::span<const LeadPart>(parts, passed), &summed)
          .wait();
      CHECK(comm->communication_rounds() - rounds == 1);
      CHECK(summed == c.summed);
      check_leads();
      if (!c.summed) {
        CHECK(x == x_before);
        CHECK(h.bytes == h_before);
        continue;
      }
      std::vector<float> x_direct = x_before;
      Buffer h_direct = h;
      h_direct.bytes = h_before;
      if (floats > 0) comm->allreduce_async(x_direct.data(), floats, DataType::Float32, Algorithm::Direct).wait();
      if (halves > 0) comm->allreduce_async(h_direct.bytes.data(), halves, type, Algorithm::Direct).wait();
      CHECK(std::memcmp(x.data(), x_direct.data(), floats * sizeof(float)) == 0);
      CHECK(h.bytes == h_direct.bytes);
    }
    // A count whose bytes overflow a size_t (2^62 + 3 floats: 12 bytes, wrapped) is beyond the capacity, not a
    // part of 3 floats: nothing summed, nothing read from it.
    std::vector<float> x = values(3, 2);
    const std::vector<float> x_before = x;
    const size_t huge = (size_t{1} << 62) + 3;
    const LeadPart part{x.data(), me == n - 1 ? huge : 3, DataType::Float32};
    summed = true;
    comm->lead_exchange_async(lead.data(), leads.data(), kLead * sizeof(double), std::span<const LeadPart>(&part, 1),
                              &summed)
        .wait();
    CHECK(!summed);
    CHECK(x == x_before);
    check_leads();
  }
  // Bad arguments: refused on the caller's thread, nothing sent (the group goes on below).
  {
    float one = 1.0f;
    const LeadPart three[] = {{&one, 1, DataType::Float32}, {&one, 1, DataType::Float32}, {&one, 1, DataType::Float32}};
    CHECK_THROWS_WITH_AS(comm->lead_exchange_async(lead.data(), leads.data(), kLead * sizeof(double), three, &summed),
                         doctest::Contains("3 data parts; expected at most 2"), InvalidArgumentError);
    const LeadPart null_part[] = {{&one, 1, DataType::Float32}, {nullptr, 4, DataType::BFloat16}};
    CHECK_THROWS_WITH_AS(
        comm->lead_exchange_async(lead.data(), leads.data(), kLead * sizeof(double), null_part, &summed),
        doctest::Contains("part 1's data is null for 4 elements"), InvalidArgumentError);
  }
  CHECK_THROWS_AS(comm->lead_exchange_async(lead.data(), leads.data(), 12, nullptr, 0, DataType::Float32, &summed),
                  InvalidArgumentError);
  CHECK_THROWS_AS(comm->lead_exchange_async(lead.data(), leads.data(), capacity + 8, nullptr, 0, DataType::Float32,
                                            &summed),
                  InvalidArgumentError);
  comm->barrier();
  comm->lead_exchange_async(lead.data(), leads.data(), kLead * sizeof(double), nullptr, 0, DataType::Float32, &summed)
      .wait();
  check_leads();
}

}  // namespace

TEST_CASE("lead exchange: leads everywhere, data summed with direct's bits only where every rank passed it alike") {
  setenv("PSGD_DIRECT_MAX_BYTES", "65536", 1);
  auto comm = connect("lead-exchange");
  unsetenv("PSGD_DIRECT_MAX_BYTES");
  const int n = comm->size();
  if (n < 2) {
    CHECK(comm->lead_exchange_capacity() == 0);
    return;
  }
  // The receives posted ahead less the lead exchange's second header word.
  lead_exchange_cases(comm.get(), 65536 / static_cast<size_t>(n - 1) / 64 * 64 - 8);
  std::vector<double> lead(4), leads(4 * static_cast<size_t>(n));
  bool summed = false;
  // Without the eager path there is none.
  setenv("PSGD_DIRECT_EAGER", "0", 1);
  auto plain = connect("lead-exchange-not-eager");
  unsetenv("PSGD_DIRECT_EAGER");
  CHECK(plain->lead_exchange_capacity() == 0);
  CHECK_THROWS_AS(plain->lead_exchange_async(lead.data(), leads.data(), 8, nullptr, 0, DataType::Float32, &summed),
                  InvalidArgumentError);
}

// Not in the tsan suite, as "direct: ranks that pass different counts" below.
TEST_CASE("lead exchange: leads of different sizes give a MismatchError on every rank; the group goes on") {
  auto comm = connect("lead-exchange-mismatch");
  const int n = comm->size();
  const int me = comm->rank();
  if (n < 2) return;
  std::vector<double> lead(4, 1.0 + me), leads(4 * static_cast<size_t>(n));
  bool summed = true;
  try {
    comm->lead_exchange_async(lead.data(), leads.data(), me == n - 1 ? 3 * sizeof(double) : 4 * sizeof(double),
                              nullptr, 0, DataType::Float32, &summed)
        .wait();
    FAIL("expected a MismatchError");
  } catch (const MismatchError& e) {
    const std::string what = e.what();
    INFO(what);
    CHECK(what.find("lead exchange: rank ") != std::string::npos);
  }
  comm->barrier();
  check_allreduce(*comm, DataType::Float32, 8, Algorithm::Direct);
  // The next lead exchange pairs as usual: every rank's lead everywhere, data summed.
  std::vector<float> x(5, 1.0f);
  comm->lead_exchange_async(lead.data(), leads.data(), 4 * sizeof(double), x.data(), x.size(), DataType::Float32,
                            &summed)
      .wait();
  CHECK(summed);
  CHECK(x[4] == static_cast<float>(n));
  for (int r = 0; r < n; ++r) CHECK(leads[4 * static_cast<size_t>(r) + 3] == 1.0 + r);
}

// Scatter-gather adds each element's contributions in rank order, as direct does: the same bits as direct at
// every size, whether its first exchange takes the receives posted ahead (every chunk within the eager capacity)
// or not, with the collectives of other kinds between, and counts smaller than the number of ranks (empty chunks).
TEST_CASE("scatter-gather: the same bits as direct at every size, eager and not, between other collectives") {
  setenv("PSGD_DIRECT_MAX_BYTES", "65536", 1);
  auto comm = connect("scatter-gather");
  unsetenv("PSGD_DIRECT_MAX_BYTES");
  const int n = comm->size();
  if (n < 2) return;
  const auto ranks = static_cast<size_t>(n);
  const size_t capacity = 65536 / (ranks - 1) / 64 * 64;  // payload bytes per peer posted ahead
  const size_t per_peer = capacity / sizeof(float);
  const size_t counts[] = {1, ranks - 1, ranks, ranks + 1, 7, per_peer * ranks, per_peer * ranks + 1, 1000,
                           3 * per_peer * ranks, per_peer * ranks - 1, 65537, 2};
  uint64_t eager = 0;
  for (int pass = 0; pass < 2; ++pass)
    for (size_t count : counts) {
      CAPTURE(pass);
      CAPTURE(count);
      std::vector<float> x(count);  // sums that round
      for (size_t i = 0; i < count; ++i)
        x[i] = 1.0f / static_cast<float>(3 + i % 101 + 7 * static_cast<size_t>(comm->rank()) + static_cast<size_t>(pass));
      std::vector<float> y = x;
      const uint64_t before = comm->eager_direct_collectives();
      comm->allreduce_async(x.data(), count, DataType::Float32, Algorithm::ScatterGather).wait();
      const size_t longest = (count + ranks - 1) / ranks * sizeof(float);
      CHECK(comm->eager_direct_collectives() - before == (longest <= capacity ? 1u : 0u));
      eager += longest <= capacity ? 1 : 0;
      comm->allreduce_async(y.data(), count, DataType::Float32, Algorithm::Direct).wait();
      CHECK(std::memcmp(x.data(), y.data(), count * sizeof(float)) == 0);
      // Every rank holds the same bits.
      std::vector<float> all(count * ranks);
      comm->allgather(x.data(), all.data(), count * sizeof(float));
      for (size_t r = 1; r < ranks; ++r)
        CHECK(std::memcmp(all.data(), all.data() + r * count, count * sizeof(float)) == 0);
      // Every type: exact sums, and sums that round give direct's bits.
      for (DataType type : kTypes) {
        check_allreduce(*comm, type, count, Algorithm::ScatterGather);
        Buffer sg(type, count);
        for (size_t i = 0; i < count; ++i)
          sg.set(i, 1.0 / static_cast<double>(3 + i % 97 + 5 * static_cast<size_t>(comm->rank())));
        Buffer direct = sg;
        comm->allreduce_async(sg.bytes.data(), count, type, Algorithm::ScatterGather).wait();
        comm->allreduce_async(direct.bytes.data(), count, type, Algorithm::Direct).wait();
        INFO(to_string(type));
        CHECK(sg.bytes == direct.bytes);
      }
      // Other collectives between.
      if (count % 2 == 0) check_allreduce(*comm, DataType::Float64, count, Algorithm::Bcube);
      float root_value = static_cast<float>(comm->rank() + 1);
      comm->broadcast(&root_value, sizeof root_value, n - 1);
      CHECK(root_value == static_cast<float>(n));
    }
  CHECK(eager > 0);
  CHECK(eager < 2 * std::size(counts));
  // Auto: scatter-gather between the direct bound and the ring threshold.
  CHECK(comm->choose(65536 / (ranks - 1) + 4) == Algorithm::ScatterGather);
  CHECK(comm->sums_in_rank_order(65536, DataType::Float32));
  // Scatter-gather on one rank and bcube on another: named at creation.
  if (comm->rank() == n - 1) setenv("PSGD_SCATTER_GATHER", "0", 1);
  try {
    connect("scatter-gather-mismatch");
    FAIL("expected a MismatchError");
  } catch (const MismatchError& e) {
    const std::string what = e.what();
    INFO(what);
    CHECK(what.find("rank " + std::to_string(n - 1) + " has PSGD_SCATTER_GATHER 0 (rank 0: 1)") != std::string::npos);
  }
  unsetenv("PSGD_SCATTER_GATHER");
}

// An algorithm forced unlike on the ranks (raw GlooCommunicator use; Auto and the engine never do): the rank
// that runs direct where its peers run scatter-gather with the same count gets a MismatchError naming both, and
// its buffer is left as it was; its peers wait for its second exchange and fail (PeerError: a timeout, or the
// connection closed when that rank's test ends).
TEST_CASE("scatter-gather: a rank that runs direct where its peers run scatter-gather is refused, not summed") {
  CommOptions o = options("scatter-gather-vs-direct");
  if (o.world_size < 2) return;
  o.timeout = std::chrono::milliseconds(1000);
  auto comm = GlooCommunicator::create(o);
  const int n = comm->size();
  std::vector<float> z(8, 1.0f);
  const bool direct = comm->rank() == n - 1;
  try {
    comm->allreduce_async(z.data(), z.size(), DataType::Float32, direct ? Algorithm::Direct : Algorithm::ScatterGather)
        .wait();
    FAIL("expected an error");
  } catch (const MismatchError& e) {
    const std::string what = e.what();
    INFO(what);
    CHECK(direct);
    CHECK(what.find("direct allreduce: rank 0 sent 32 bytes with scatter-gather where this rank (" +
                    std::to_string(n - 1) + ") reduces 32 with direct") != std::string::npos);
    CHECK(std::count(z.begin(), z.end(), 1.0f) == 8);
  } catch (const PeerError& e) {
    INFO(std::string(e.what()));
    CHECK_FALSE(direct);
    // A timeout, or the connection closed once the direct rank's test ended: never a hang, never a sum.
    CHECK((e.code() == ErrorCode::Timeout || e.code() == ErrorCode::Io));
    CHECK(std::count(z.begin(), z.end(), 1.0f) == 8);
  }
}

// Not in the tsan suite, as the direct case above. Within the receives posted ahead: a count beyond them on some
// ranks only is a timeout (every rank must pass the same count, Communicator's contract).
TEST_CASE("scatter-gather: ranks that pass different counts get a MismatchError naming both; the group goes on") {
  auto comm = connect("scatter-gather-count");
  const int n = comm->size();
  if (n < 2) return;
  const size_t count = 8 * static_cast<size_t>(n);
  std::vector<float> z(count, 1.0f);
  const size_t mine = comm->rank() == n - 1 ? count - 1 : count;
  for (int k = 0; k < 2; ++k) {
    try {
      comm->allreduce_async(z.data(), mine, DataType::Float32, Algorithm::ScatterGather).wait();
      FAIL("expected a MismatchError");
    } catch (const MismatchError& e) {
      const std::string what = e.what();
      INFO(what);
      const std::string other = comm->rank() == n - 1 ? std::to_string(count * 4) : std::to_string((count - 1) * 4);
      CHECK(what.find("scatter-gather allreduce: rank ") != std::string::npos);
      CHECK(what.find(" sent " + other + " bytes where this rank") != std::string::npos);
    }
    // Nothing was written: a refused collective leaves the buffer as it was.
    CHECK(std::count(z.begin(), z.end(), 1.0f) == static_cast<long>(count));
  }
  CHECK(comm->eager_direct_collectives() == 2);
  comm->barrier();
  check_allreduce(*comm, DataType::Float32, count, Algorithm::ScatterGather);
  check_allreduce(*comm, DataType::Float32, 8, Algorithm::Direct);
}

TEST_CASE("direct: PSGD_DIRECT_MAX_BYTES=auto chooses one bound on every rank from the measured latency") {
  CHECK(GlooCommunicator::direct_bound_for(50e-6) == 262144);
  CHECK(GlooCommunicator::direct_bound_for(2e-3) == 1048576);
  CHECK(GlooCommunicator::direct_bound_for(5e-3) == 4194304);
  // And the link's rate: at 1 Gbit/s (8 ns per byte), with scatter-gather's extra round d measured at 5 ms, direct
  // pays while (n - 1) B <= d / c x n / (n - 2), rounded down to 4 KiB; never above the latency's bound, nor
  // below a LAN's.
  CHECK(GlooCommunicator::direct_bound_for(10e-3, 5e-3, 8e-9, 8) == 831488);   // 833,333
  CHECK(GlooCommunicator::direct_bound_for(10e-3, 5e-3, 8e-9, 4) == 1249280);  // 1,250,000
  CHECK(GlooCommunicator::direct_bound_for(10e-3, 5e-3, 8e-9, 16) == 712704);  // 714,285
  CHECK(GlooCommunicator::direct_bound_for(3e-3, 1.5e-3, 4e-9, 8) == 499712);  // 500,000
  CHECK(GlooCommunicator::direct_bound_for(2e-3, 1e-3, 8e-9, 8) == 262144);    // 166,666: a LAN's bound
  CHECK(GlooCommunicator::direct_bound_for(10e-3, 0, 8e-9, 8) == 262144);      // no round to save
  CHECK(GlooCommunicator::direct_bound_for(10e-3, 5e-3, 8e-10, 8) == 4194304); // 10 Gbit/s: the latency's
  CHECK(GlooCommunicator::direct_bound_for(10e-3, 5e-3, 8e-9, 2) == 4194304);  // two parties: direct is never slower
  CHECK(GlooCommunicator::direct_bound_for(10e-3, 5e-3, 0, 8) == 4194304);     // not measured
  CHECK(GlooCommunicator::direct_bound_for(50e-6, 50e-6, 1e-6, 8) == 262144);
  CHECK(GlooCommunicator::direct_bound_for(10e-3, 5e-3, std::nan(""), 8) == 4194304);
  CHECK(GlooCommunicator::direct_bound_for(10e-3, std::nan(""), 8e-9, 8) == 4194304);
  CHECK(GlooCommunicator::direct_bound_for(std::nan(""), 5e-3, 8e-9, 8) == 262144);
  auto in_range = [](uint64_t bound) { return bound >= 262144 && bound <= 4194304 && bound % 4096 == 0; };
  setenv("PSGD_DIRECT_MAX_BYTES", "auto", 1);
  auto comm = connect("direct-auto");
  unsetenv("PSGD_DIRECT_MAX_BYTES");
  const uint64_t mine = comm->direct_max_bytes();
  CHECK(in_range(mine));
  std::vector<uint64_t> all(static_cast<size_t>(comm->size()));
  comm->allgather(&mine, all.data(), sizeof(mine));
  for (uint64_t bound : all) CHECK(bound == mine);
  check_allreduce(*comm, DataType::Float32, 1001, Algorithm::Auto);
  // Unset: auto (scatter-gather above the bound adds as direct does); with bcube above it 256 KiB.
  auto by_default = connect("direct-auto-default");
  const uint64_t measured = by_default->direct_max_bytes();
  CHECK(in_range(measured));
  by_default->allgather(&measured, all.data(), sizeof(measured));
  for (uint64_t bound : all) CHECK(bound == measured);
  setenv("PSGD_SCATTER_GATHER", "0", 1);
  auto with_bcube = connect("direct-auto-bcube");
  unsetenv("PSGD_SCATTER_GATHER");
  CHECK(with_bcube->direct_max_bytes() == 262144);
  // auto on one rank, a number on another: named at creation, as any setting that differs.
  if (comm->size() < 2) return;
  setenv("PSGD_DIRECT_MAX_BYTES", comm->rank() == 1 ? "auto" : "262144", 1);
  try {
    connect("direct-auto-mismatch");
    FAIL("expected a MismatchError");
  } catch (const MismatchError& e) {
    const std::string what = e.what();
    INFO(what);
    CHECK(what.find("PSGD_DIRECT_MAX_BYTES auto (rank 0: 262144)") != std::string::npos);
  }
  unsetenv("PSGD_DIRECT_MAX_BYTES");
}

TEST_CASE("rounds: each collective adds its algorithm's sequential rounds") {
  auto comm = connect("rounds");
  const auto n = static_cast<uint64_t>(comm->size());
  uint64_t log2n = 0;
  while ((uint64_t{1} << log2n) < n) ++log2n;
  uint64_t bcube = 0;  // Gloo's radix-2 bcube: a step per factor 2 of n and one for the rest, each way
  for (uint64_t m = n; m > 1; m = m % 2 == 0 ? m / 2 : 1) ++bcube;
  bcube *= 2;
  std::vector<float> data(1000, 1.0f);
  const auto rounds_of = [&](auto&& collective) {
    const uint64_t before = comm->communication_rounds();
    collective();
    return comm->communication_rounds() - before;
  };
  CHECK(rounds_of([&] { comm->allreduce_async(data.data(), 10, DataType::Float32, Algorithm::Direct).wait(); }) == 1);
  CHECK(rounds_of([&] { comm->allreduce_async(data.data(), 10, DataType::Float32, Algorithm::Bcube).wait(); }) == bcube);
  CHECK(rounds_of([&] { comm->allreduce_async(data.data(), 10, DataType::Float32, Algorithm::ScatterGather).wait(); }) ==
        2);
  CHECK(rounds_of([&] { comm->allreduce_async(data.data(), 10, DataType::Float32, Algorithm::Ring).wait(); }) ==
        2 * (n - 1));
  CHECK(rounds_of([&] { comm->allreduce(data.data(), 10, DataType::Float32); }) == 1);  // auto: direct, its header
  // The public broadcast and allgather send their shapes first, one round (the lead exchange); with the sizes
  // agreed (the engine's calls) the algorithm's rounds alone.
  using Sizes = GlooCommunicator::Sizes;
  CHECK(rounds_of([&] { comm->broadcast(data.data(), 16, 0); }) == log2n + 1);
  CHECK(rounds_of([&] { comm->broadcast_async(data.data(), 16, 0, Sizes::Agreed).wait(); }) == log2n);
  // A small allgather is one exchange with every peer (n - 1 rounds fewer than Gloo's ring).
  std::vector<float> all(n);
  CHECK(rounds_of([&] { comm->allgather(data.data(), all.data(), sizeof(float)); }) == (n > 1 ? 1 : 0) + 1);
  CHECK(rounds_of([&] { comm->allgather_async(data.data(), all.data(), sizeof(float), Sizes::Agreed).wait(); }) ==
        (n > 1 ? 1 : 0));
  // The barrier is the shapes' exchange: one round (the lead exchange).
  CHECK(rounds_of([&] { comm->barrier(); }) == (n > 1 ? 1 : 0));
  // A count of 0: nothing sent but the shape (publicly), nothing at all with the sizes agreed.
  CHECK(rounds_of([&] { comm->allreduce_async(data.data(), 0, DataType::Float32).wait(); }) == 1);
  CHECK(rounds_of([&] { comm->allreduce_async(data.data(), 0, DataType::Float32, Algorithm::Auto, Sizes::Agreed).wait(); }) == 0);
}

TEST_CASE("legacy api: halving-doubling, ring-chunked, broadcast, allgather, barrier") {
  // The old-style algorithms are what ibverbs uses; TCP runs them here.
  auto comm = connect("legacy", GlooApi::Legacy);
  CHECK(comm->choose(1) == Algorithm::HalvingDoubling);
  for (DataType type : kTypes)
    for (size_t count : kCounts) check_allreduce(*comm, type, count, Algorithm::Auto);
  for (size_t count : kCounts) check_allreduce(*comm, DataType::Float32, count, Algorithm::Ring);
  for (int root = 0; root < comm->size(); ++root) {
    std::vector<uint8_t> data(100003, comm->rank() == root ? static_cast<uint8_t>(root + 1) : 0);
    comm->broadcast(data.data(), data.size(), root);
    CHECK(std::count(data.begin(), data.end(), static_cast<uint8_t>(root + 1)) == static_cast<long>(data.size()));
  }
  std::vector<int32_t> in(333, comm->rank()), out(333 * static_cast<size_t>(comm->size()), -1);
  comm->allgather(in.data(), out.data(), in.size() * sizeof(int32_t));
  for (size_t i = 0; i < out.size(); ++i) REQUIRE(out[i] == static_cast<int32_t>(i / 333));
  comm->barrier();
  leave_together(*comm, "legacy-left-barrier");
}

// Ranks that pass different sizes to a public collective where Gloo's own algorithms run (their receives are
// sized by the caller: before, Gloo's I/O thread threw and the process aborted, or a broadcast's larger receiver
// kept stale bytes) get a MismatchError on every rank naming both sizes; nothing was sent, no buffer changed,
// and the group goes on. The last rank is the odd one. Not in the tsan suite, as the mismatch cases above.
namespace {
void expect_refused(GlooCommunicator& comm, const std::function<void()>& call, const std::string& theirs,
                    const std::string& mine) {
  const int n = comm.size(), me = comm.rank();
  const int first_other = me == n - 1 ? 0 : n - 1;  // the first rank whose call differs from this rank's
  try {
    call();
    FAIL("expected a MismatchError");
  } catch (const MismatchError& e) {
    const std::string what = e.what();
    INFO(what);
    CHECK(what.find(detail::concat("rank ", first_other, " calls ", theirs, " where this rank (", me, ") calls ",
                                   mine, ": every rank must run the same collectives with the same sizes")) !=
          std::string::npos);
  }
}

std::vector<std::vector<int>> test_hosts();

// The MismatchError every rank gets where the ranks `odd` says pass a lead of `lead_bytes` and the others a
// public collective (its shape): unstaged (`hosts` empty) naming the first rank whose kind is not rank 0's;
// staged, the first host's leader whose kind is not rank 0's, else the first rank of the first host whose kind
// is not its leader's. Without the prefix a public collective's rank adds.
template <typename Odd>
std::string kind_mismatch_message(const std::vector<std::vector<int>>& hosts, int n, int me, size_t lead_bytes,
                                  Odd odd) {
  const std::string shape = "the shape a public collective sends first (or a refused call)";
  const std::string a_lead = detail::concat("a lead of ", lead_bytes, " bytes");
  const auto kind_of = [&](int r) { return odd(r) ? a_lead : shape; };
  const std::string tail = detail::concat(" (this rank, ", me, ": ", kind_of(me),
                                          "): every rank must run the same collectives in the same order");
  if (hosts.empty()) {
    for (int r = 1; r < n; ++r)
      if (odd(r) != odd(0))
        return detail::concat("lead exchange: rank ", r, " sent ", kind_of(r), " where rank 0 sent ", kind_of(0), tail);
  }
  for (const auto& host : hosts)
    if (odd(host.front()) != odd(0))
      return detail::concat("lead exchange: rank ", host.front(), ", its host's leader, passed ", kind_of(host.front()),
                            " where rank 0 passed ", odd(0) ? "a lead" : shape, tail);
  for (const auto& host : hosts)
    for (int r : host)
      if (odd(r) != odd(host.front()))
        return detail::concat("lead exchange: rank ", r, " passed ", kind_of(r),
                              " where its host's leader passed another", tail);
  return "no rank differs";
}

void check_sizes_refused(GlooCommunicator& comm) {
  const int n = comm.size(), me = comm.rank();
  const bool odd = me == n - 1;
  const auto both = [&](const std::string& usual, const std::string& unusual) {
    return std::make_pair(odd ? usual : unusual, odd ? unusual : usual);  // (theirs, mine) as this rank sees it
  };
  // An allreduce above the ring threshold (64 KiB here): the ring's receives, or halving-doubling's (legacy).
  const size_t usual = 32768, count = odd ? usual + 16 : usual;
  std::vector<float> values(count, 1.0f);
  auto [theirs, mine] = both("allreduce of 32768 x float32", "allreduce of 32784 x float32");
  expect_refused(comm, [&] { comm.allreduce(values.data(), count, DataType::Float32); }, theirs, mine);
  CHECK(std::count(values.begin(), values.end(), 1.0f) == static_cast<long>(count));
  // The same count in another type.
  std::tie(theirs, mine) = both("allreduce of 32768 x float32", "allreduce of 32768 x float64");
  std::vector<double> wide(usual, 1.0);
  expect_refused(
      comm,
      [&] {
        if (odd)
          comm.allreduce(wide.data(), usual, DataType::Float64);
        else
          comm.allreduce(values.data(), usual, DataType::Float32);
      },
      theirs, mine);
  // A count of 0 where the others pass some: the others' check waits for it, not a timeout.
  std::tie(theirs, mine) = both("allreduce of 32768 x float32", "allreduce of 0 x float32");
  expect_refused(comm, [&] { comm.allreduce(values.data(), odd ? 0 : usual, DataType::Float32); }, theirs, mine);
  // A broadcast whose receiver passes fewer bytes (before: Gloo aborted), and one whose root passes fewer (before:
  // the receivers' last bytes were silently left as they were).
  std::vector<uint8_t> bytes(8192, static_cast<uint8_t>(me + 1));
  std::tie(theirs, mine) = both("broadcast of 8192 bytes from root 0", "broadcast of 4096 bytes from root 0");
  expect_refused(comm, [&] { comm.broadcast(bytes.data(), odd ? 4096 : 8192, 0); }, theirs, mine);
  std::tie(theirs, mine) = both("broadcast of 4096 bytes from root 0", "broadcast of 8192 bytes from root 0");
  expect_refused(comm, [&] { comm.broadcast(bytes.data(), odd ? 8192 : 4096, 0); }, theirs, mine);
  // Another root.
  std::tie(theirs, mine) = both("broadcast of 4096 bytes from root 0", detail::concat("broadcast of 4096 bytes from root ", n - 1));
  expect_refused(comm, [&] { comm.broadcast(bytes.data(), 4096, odd ? n - 1 : 0); }, theirs, mine);
  CHECK(std::count(bytes.begin(), bytes.end(), static_cast<uint8_t>(me + 1)) == 8192);
  // An allgather of other sizes, and another collective altogether.
  std::vector<uint8_t> gathered(64 * static_cast<size_t>(n), 0);
  std::tie(theirs, mine) = both("allgather of 16 bytes per rank", "allgather of 32 bytes per rank");
  expect_refused(comm, [&] { comm.allgather(bytes.data(), gathered.data(), odd ? 32 : 16); }, theirs, mine);
  CHECK(std::count(gathered.begin(), gathered.end(), 0) == static_cast<long>(gathered.size()));
  std::tie(theirs, mine) = both("allgather of 16 bytes per rank", "broadcast of 16 bytes from root 0");
  expect_refused(
      comm,
      [&] {
        if (odd)
          comm.broadcast(bytes.data(), 16, 0);
        else
          comm.allgather(bytes.data(), gathered.data(), 16);
      },
      theirs, mine);
  // A barrier, and check_same, against another collective (before: the barrier waited for the timeout and broke
  // the group; with the legacy API, or without the lead exchange, Gloo aborted a rank).
  std::tie(theirs, mine) = both("broadcast of 16 bytes from root 0", "barrier");
  expect_refused(
      comm,
      [&] {
        if (odd)
          comm.barrier();
        else
          comm.broadcast(bytes.data(), 16, 0);
      },
      theirs, mine);
  std::tie(theirs, mine) = both("allgather of 8 bytes per rank", "check_same");
  expect_refused(
      comm,
      [&] {
        if (odd)
          comm.check_same(42, "the test's fingerprint");
        else
          comm.allgather(bytes.data(), gathered.data(), 8);
      },
      theirs, mine);
  CHECK(std::count(gathered.begin(), gathered.end(), 0) == static_cast<long>(gathered.size()));
  // check_same itself: a differing fingerprint names the first rank that differs from rank 0 (the last rank
  // here), and the group stays usable.
  try {
    comm.check_same(odd ? 43 : 42, "the test's fingerprint");
    FAIL("expected a MismatchError");
  } catch (const MismatchError& e) {
    CHECK(std::string(e.what()) ==
          detail::concat("the test's fingerprint differs between ranks: rank ", n - 1, " has fingerprint 2b, rank 0 "
                         "has 2a"));
  }
  CHECK_NOTHROW(comm.check_same(42, "the test's fingerprint"));
  // The public allreduce and allreduce_in_rank_order_async of one count, where they choose different algorithms
  // (the ring above the threshold; direct or scatter-gather): the shapes name the algorithms, or, where one side
  // is direct on the receives posted ahead (no shape), each reads the other's message as the wrong kind.
  if (comm.api() == GlooApi::New) {
    const Algorithm ordered = comm.choose_in_rank_order(usual * sizeof(float));
    REQUIRE(comm.choose(usual * sizeof(float)) == Algorithm::Ring);
    REQUIRE(ordered != Algorithm::Ring);
    try {
      if (odd)
        comm.allreduce_in_rank_order_async(values.data(), usual, DataType::Float32).wait();
      else
        comm.allreduce(values.data(), usual, DataType::Float32);
      FAIL("expected a MismatchError");
    } catch (const MismatchError& e) {
      const std::string what = e.what();
      INFO(what);
      if (comm.lead_capacity() == 0 || ordered == Algorithm::ScatterGather)
        CHECK(what.find(odd ? detail::concat("x float32 by ring where this rank (", me, ") calls allreduce of ", usual,
                                             " x float32 by ", to_string(ordered))
                            : detail::concat("x float32 by ", to_string(ordered), " where this rank (", me,
                                             ") calls allreduce of ", usual, " x float32 by ring")) != std::string::npos);
    }
    CHECK(std::count(values.begin(), values.begin() + usual, 1.0f) == static_cast<long>(usual));
  }
  // A lead exchange's lead (a shape's 24 bytes, then 32) against a public collective's shape: every rank fails,
  // naming the same rank and each kind (the lead exchange's header says it; before, a 24-byte lead's rank took
  // the shape for its peer's lead); no lead arrives.
  for (const size_t lead_bytes : {size_t{24}, size_t{32}}) {
    if (comm.lead_capacity() < lead_bytes) break;
    CAPTURE(lead_bytes);
    std::vector<uint64_t> lead(lead_bytes / 8, 7), leads(lead_bytes / 8 * static_cast<size_t>(n), 0);
    bool summed = true;
    try {
      if (odd)
        comm.lead_exchange_async(lead.data(), leads.data(), lead_bytes, nullptr, 0, DataType::Float32, &summed).wait();
      else
        comm.broadcast(bytes.data(), 16, 0);
      FAIL("expected a MismatchError");
    } catch (const MismatchError& e) {
      const std::string what = e.what();
      INFO(what);
      const std::string expected =
          kind_mismatch_message(comm.staged_hosts() > 0 ? test_hosts() : std::vector<std::vector<int>>{}, n, me,
                                lead_bytes, [&](int r) { return r == n - 1; });
      CHECK(what == (odd ? expected : "broadcast of 16 bytes from root 0, its shape sent first: " + expected));
    }
    CHECK(std::count(leads.begin(), leads.end(), 0) == static_cast<long>(leads.size()));
  }
  // The group goes on: the same calls with the same sizes, through the public path (its shapes agree).
  comm.barrier();
  Buffer summed(DataType::Float32, usual);
  for (size_t i = 0; i < usual; ++i) summed.set(i, value(me, i));
  comm.allreduce(summed.bytes.data(), usual, DataType::Float32);
  CHECK(first_wrong(summed, n) == usual);
  std::vector<uint8_t> from_root(8192, me == 0 ? 7 : 0);
  comm.broadcast(from_root.data(), from_root.size(), 0);
  CHECK(std::count(from_root.begin(), from_root.end(), 7) == 8192);
  std::vector<int32_t> in(4, me), out(4 * static_cast<size_t>(n), -1);
  comm.allgather(in.data(), out.data(), in.size() * sizeof(int32_t));
  for (size_t i = 0; i < out.size(); ++i) CHECK(out[i] == static_cast<int32_t>(i / 4));
}

// Ranks whose counts take different paths of the public allreduce: one reads headers, another sends its shape
// first, or both send shapes. Each side fails at once (MismatchError) on every rank, no buffer changes, and the
// group goes on. `odd_count` on the last rank, `count` elsewhere.
void check_paths_refused(GlooCommunicator& comm, size_t count, size_t odd_count) {
  const int n = comm.size(), me = comm.rank();
  const size_t mine = me == n - 1 ? odd_count : count;
  INFO("this rank's count ", mine, " (", to_string(comm.choose(mine * sizeof(float))), "), the others' ",
       me == n - 1 ? count : odd_count);
  std::vector<float> values(std::max(count, odd_count), 1.0f);
  const auto start = Clock::now();
  CHECK_THROWS_AS(comm.allreduce(values.data(), mine, DataType::Float32), MismatchError);
  CHECK(Clock::now() - start < std::chrono::seconds(10));  // not the 120 s timeout
  CHECK(std::count(values.begin(), values.end(), 1.0f) == static_cast<long>(values.size()));
  Buffer summed(DataType::Float32, count);
  for (size_t i = 0; i < count; ++i) summed.set(i, value(me, i));
  comm.allreduce(summed.bytes.data(), count, DataType::Float32);
  CHECK(first_wrong(summed, n) == count);
}

// A public collective refused on some ranks for their own arguments (a root out of range, a null buffer): each
// of those throws its own InvalidArgumentError, every other rank a MismatchError naming the lowest refusing
// rank, at once (before, the others waited out the timeout and the group broke); nothing was sent, no buffer
// changed, and the group goes on.
const DataType kUnknownType = static_cast<DataType>(9);
const std::string kUnknownTypeError =
    "allreduce: unknown DataType 9: expected float32, float64, float16 or bfloat16";

void check_refusals(GlooCommunicator& comm) {
  const int n = comm.size(), me = comm.rank();
  // `theirs`: what a rank that did not refuse says where it is not the shapes' message below (the direct
  // allreduce's headers); `own`: what a refusing rank says.
  const auto expect = [&](const std::function<bool(int)>& refuses, const std::function<void(bool)>& call,
                          const std::string& operation, const std::string& mine, const std::string& own,
                          std::string theirs = {}) {
    int first = 0;
    while (!refuses(first)) ++first;
    int refusing = 0;
    for (int r = 0; r < n; ++r) refusing += refuses(r) ? 1 : 0;
    if (theirs.empty())
      theirs = detail::concat(operation, ": rank ", first,
                              refusing > 1 ? detail::concat(" (and ", refusing - 1, " other rank(s))") : std::string(),
                              " refused its ", operation, " (its own arguments: that rank's error says why) where "
                              "this rank (", me, ") calls ", mine, ": nothing was sent; the group stays usable");
    CAPTURE(first);
    CAPTURE(refusing);
    const auto start = Clock::now();
    try {
      call(refuses(me));
      FAIL("expected a refusal");
    } catch (const InvalidArgumentError& e) {
      CHECK(refuses(me));
      CHECK(std::string(e.what()) == own);
    } catch (const MismatchError& e) {
      CHECK(!refuses(me));
      CHECK(std::string(e.what()) == theirs);
    }
    CHECK(Clock::now() - start < std::chrono::seconds(10));  // not the 120 s timeout
  };
  const std::vector<std::function<bool(int)>> refusers = {
      [&](int r) { return r == n - 1; }, [](int r) { return r == 0; }, [&](int r) { return r == 0 || r == n - 1; }};
  for (const auto& refuses : refusers) {
    std::vector<uint8_t> bytes(4096, static_cast<uint8_t>(me + 1));
    expect(refuses, [&](bool refusing) { comm.broadcast(bytes.data(), 16, refusing ? n : 0); }, "broadcast",
           "broadcast of 16 bytes from root 0",
           detail::concat("broadcast: root ", n, " is out of range: expected 0 to ", n - 1));
    expect(refuses, [&](bool refusing) { comm.broadcast(refusing ? nullptr : bytes.data(), 16, 0); }, "broadcast",
           "broadcast of 16 bytes from root 0", "broadcast: data is null for 16 bytes");
    CHECK(std::count(bytes.begin(), bytes.end(), static_cast<uint8_t>(me + 1)) == 4096);
    std::vector<uint8_t> gathered(16 * static_cast<size_t>(n), 0);
    expect(refuses, [&](bool refusing) { comm.allgather(bytes.data(), refusing ? nullptr : gathered.data(), 16); },
           "allgather", "allgather of 16 bytes per rank", "allgather: null buffer for 16 bytes");
    CHECK(std::count(gathered.begin(), gathered.end(), 0) == static_cast<long>(gathered.size()));
    // Above the ring threshold (64 KiB here) every path sends the shapes first; 16 elements take the direct
    // allreduce on the receives posted ahead where there are some and nothing is staged: its headers, no shapes.
    std::vector<float> values(32768, 1.0f);
    for (const size_t count : {size_t{32768}, size_t{16}}) {
      CAPTURE(count);
      const bool headers = count == 16 && comm.staged_hosts() == 0 && comm.lead_capacity() >= 64 &&
                           comm.choose(64) == Algorithm::Direct;
      const std::string theirs =
          headers ? detail::concat("direct allreduce: rank ", refuses(0) ? 0 : n - 1,
                                   " sent the shape a public collective sends first (another collective, or a call "
                                   "that rank refused: its own error says why) where this rank (", me,
                                   ") reduces 64 bytes: every rank must run the same collectives in the same order")
                  : std::string();
      expect(
          refuses,
          [&](bool refusing) { comm.allreduce(refusing ? nullptr : values.data(), count, DataType::Float32); },
          "allreduce", detail::concat("allreduce of ", count, " x float32"),
          detail::concat("allreduce: data is null for ", count, " elements"), theirs);
      // A DataType outside the enum (a C++ caller's cast) is refused like any bad argument: its size was read
      // on that rank alone before the refusal, which left its peers waiting for the timeout.
      expect(
          refuses,
          [&](bool refusing) { comm.allreduce(values.data(), count, refusing ? kUnknownType : DataType::Float32); },
          "allreduce", detail::concat("allreduce of ", count, " x float32"), kUnknownTypeError, theirs);
    }
    // The same in rank order, whose algorithm is chosen by the type's size before the call.
    if (comm.choose_in_rank_order(64) != Algorithm::Auto) {
      try {
        comm.allreduce_in_rank_order_async(values.data(), 16, refuses(me) ? kUnknownType : DataType::Float32)
            .wait();
        FAIL("expected a refusal");
      } catch (const InvalidArgumentError& e) {
        CHECK(refuses(me));
        CHECK(std::string(e.what()) == kUnknownTypeError);
      } catch (const MismatchError&) {
        CHECK(!refuses(me));
      }
    }
    CHECK(std::count(values.begin(), values.end(), 1.0f) == 32768);
    // An argument every rank refuses (halving-doubling needs the legacy API), where some also pass a null
    // buffer: every rank refuses, each with its first error, and the sequence stays aligned.
    if (comm.api() == GlooApi::New) {
      try {
        comm.allreduce_async(refuses(me) ? nullptr : values.data(), 16, DataType::Float32,
                             Algorithm::HalvingDoubling, GlooCommunicator::Sizes::Unknown)
            .wait();
        FAIL("expected a refusal");
      } catch (const InvalidArgumentError& e) {
        CHECK(std::string(e.what()) == (refuses(me) ? "allreduce: data is null for 16 elements"
                                                    : "allreduce: halving-doubling needs Gloo's legacy API"));
      }
    }
  }
  // A lead exchange that some ranks refuse (a lead of 12 bytes: not a multiple of 8) sends the refusal as a
  // shape: its peers' leads fail on the kinds, their public collectives name the refused lead exchange.
  if (comm.lead_capacity() >= 32) {
    const std::vector<std::vector<int>> hosts =
        comm.staged_hosts() > 0 ? test_hosts() : std::vector<std::vector<int>>{};
    const std::string own =
        detail::concat("lead exchange: a lead of 12 bytes; expected a positive multiple of 8 up to the capacity ",
                       comm.lead_capacity());
    for (const auto& refuses : refusers) {
      std::vector<uint64_t> lead(4, 7), leads(4 * static_cast<size_t>(n), 0);
      bool summed = true;
      const auto lead_exchange = [&](size_t lead_bytes) {
        comm.lead_exchange_async(lead.data(), leads.data(), lead_bytes, nullptr, 0, DataType::Float32, &summed)
            .wait();
      };
      expect(refuses, [&](bool refusing) { lead_exchange(refusing ? 12 : 32); }, "lead exchange", "", own,
             kind_mismatch_message(hosts, n, me, 32, [&](int r) { return !refuses(r); }));
      expect(
          refuses,
          [&](bool refusing) {
            comm.lead_exchange_async(lead.data(), leads.data(), 32, nullptr, 0,
                                     refusing ? kUnknownType : DataType::Float32, &summed)
                .wait();
          },
          "lead exchange", "", "lead exchange: unknown DataType 9: expected float32, float64, float16 or bfloat16",
          kind_mismatch_message(hosts, n, me, 32, [&](int r) { return !refuses(r); }));
      std::vector<uint8_t> bytes(16, static_cast<uint8_t>(me + 1));
      expect(
          refuses,
          [&](bool refusing) {
            if (refusing)
              lead_exchange(12);
            else
              comm.broadcast(bytes.data(), 16, 0);
          },
          "broadcast", "broadcast of 16 bytes from root 0", own,
          detail::concat("broadcast: rank ", refuses(0) ? 0 : n - 1,
                         refuses(0) && refuses(n - 1) && n > 2 ? " (and 1 other rank(s))" : "",
                         " refused its lead exchange (its own arguments: that rank's error says why) where this rank (",
                         me, ") calls broadcast of 16 bytes from root 0: nothing was sent; the group stays usable"));
      CHECK(std::count(leads.begin(), leads.end(), 0) == static_cast<long>(leads.size()));
      CHECK(std::count(bytes.begin(), bytes.end(), static_cast<uint8_t>(me + 1)) == 16);
    }
  }
  // The group goes on.
  comm.barrier();
  Buffer summed(DataType::Float32, 4096);
  for (size_t i = 0; i < 4096; ++i) summed.set(i, value(me, i));
  comm.allreduce(summed.bytes.data(), 4096, DataType::Float32);
  CHECK(first_wrong(summed, n) == 4096);
  std::vector<uint8_t> from_root(64, me == n - 1 ? 9 : 0);
  comm.broadcast(from_root.data(), from_root.size(), n - 1);
  CHECK(std::count(from_root.begin(), from_root.end(), 9) == 64);
}

CommOptions small_ring_threshold(const char* run_id) {
  CommOptions o = options(run_id);
  o.ring_threshold_bytes = 64 * 1024;
  return o;
}
}  // namespace

TEST_CASE("sizes: ranks that pass different sizes to a public collective get a MismatchError naming both") {
  if (comm_world() < 2) return;
  SUBCASE("the lead exchange carries the sizes") {
    auto comm = GlooCommunicator::create(small_ring_threshold("sizes-lead"));
    REQUIRE(comm->lead_capacity() > 0);
    const uint64_t rounds = comm->rounds();
    check_sizes_refused(*comm);
    // One round per check where it carried them; the eager direct and scatter-gather allreduces check their own.
    CHECK(comm->rounds() > rounds);
  }
  SUBCASE("without it, Gloo's allgather of the sizes (PSGD_DIRECT_EAGER=0)") {
    setenv("PSGD_DIRECT_EAGER", "0", 1);
    auto comm = GlooCommunicator::create(small_ring_threshold("sizes-allgather"));
    unsetenv("PSGD_DIRECT_EAGER");
    REQUIRE(comm->lead_capacity() == 0);
    check_sizes_refused(*comm);
  }
  SUBCASE("the legacy API") {
    auto comm = GlooCommunicator::create(small_ring_threshold("sizes-legacy"), GlooApi::Legacy);
    check_sizes_refused(*comm);
    leave_together(*comm, "sizes-legacy-left");
  }
  SUBCASE("counts on two paths: direct and scatter-gather, scatter-gather and the ring") {
    setenv("PSGD_DIRECT_MAX_BYTES", "16384", 1);
    auto comm = GlooCommunicator::create(small_ring_threshold("sizes-paths"));
    unsetenv("PSGD_DIRECT_MAX_BYTES");
    // The largest count direct takes (one header), and one more (scatter-gather: a shape first); scatter-gather
    // against the ring; a count of 0 against direct.
    const size_t parties = static_cast<size_t>(comm->staged_hosts() > 0 ? comm->staged_hosts() : comm->size());
    const size_t direct = 16384 / (parties - 1) / sizeof(float), ring = 64 * 1024 / sizeof(float);
    REQUIRE(comm->choose(direct * sizeof(float)) == Algorithm::Direct);
    REQUIRE(comm->choose((direct + 1) * sizeof(float)) == Algorithm::ScatterGather);
    REQUIRE(comm->choose((ring - 1) * sizeof(float)) == Algorithm::ScatterGather);
    REQUIRE(comm->choose(ring * sizeof(float)) == Algorithm::Ring);
    check_paths_refused(*comm, direct, direct + 1);
    check_paths_refused(*comm, direct + 1, direct);
    check_paths_refused(*comm, ring - 1, ring);
    check_paths_refused(*comm, ring, ring - 1);
    check_paths_refused(*comm, 16, 0);
    check_paths_refused(*comm, 16, 17);
  }
}

TEST_CASE("sizes: a call that one rank refuses fails on every rank at once, naming that rank; the group goes on") {
  if (comm_world() < 2) return;
  SUBCASE("the lead exchange carries the refusal") {
    auto comm = GlooCommunicator::create(small_ring_threshold("refusals-lead"));
    REQUIRE(comm->lead_capacity() > 0);
    check_refusals(*comm);
  }
  SUBCASE("without it, Gloo's allgather of the shapes (PSGD_DIRECT_EAGER=0)") {
    setenv("PSGD_DIRECT_EAGER", "0", 1);
    auto comm = GlooCommunicator::create(small_ring_threshold("refusals-allgather"));
    unsetenv("PSGD_DIRECT_EAGER");
    REQUIRE(comm->lead_capacity() == 0);
    check_refusals(*comm);
  }
  SUBCASE("the legacy API") {
    auto comm = GlooCommunicator::create(small_ring_threshold("refusals-legacy"), GlooApi::Legacy);
    check_refusals(*comm);
    leave_together(*comm, "refusals-legacy-left");
  }
}

TEST_CASE("broadcast: every root, 1 byte to several MiB") {
  auto comm = connect("broadcast");
  for (size_t bytes : {size_t{1}, size_t{1001}, size_t{5} * 1024 * 1024 + 3})
    for (int root = 0; root < comm->size(); ++root) {
      std::vector<uint8_t> data(bytes);
      for (size_t i = 0; i < bytes; ++i)
        data[i] = comm->rank() == root ? static_cast<uint8_t>(i * 7 + static_cast<size_t>(root)) : 0;
      comm->broadcast(data.data(), bytes, root);
      size_t wrong = 0;
      for (size_t i = 0; i < bytes; ++i) wrong += data[i] != static_cast<uint8_t>(i * 7 + static_cast<size_t>(root));
      INFO("bytes ", bytes, " root ", root);
      CHECK(wrong == 0);
    }
  CHECK_THROWS_AS(comm->broadcast_async(nullptr, 0, comm->size()), InvalidArgumentError);
}

TEST_CASE("allgather: 1 byte to several MiB per rank") {
  auto comm = connect("allgather");
  size_t n = static_cast<size_t>(comm->size());
  for (size_t bytes : {size_t{1}, size_t{333}, size_t{2} * 1024 * 1024 + 1}) {
    std::vector<uint8_t> in(bytes), out(bytes * n, 0xEE);
    for (size_t i = 0; i < bytes; ++i) in[i] = static_cast<uint8_t>(i + 31 * static_cast<size_t>(comm->rank()));
    comm->allgather(in.data(), out.data(), bytes);
    size_t wrong = 0;
    for (size_t r = 0; r < n; ++r)
      for (size_t i = 0; i < bytes; ++i) wrong += out[r * bytes + i] != static_cast<uint8_t>(i + 31 * r);
    INFO("bytes ", bytes);
    CHECK(wrong == 0);
  }
}

// Up to 1 MiB received per rank the allgather is one exchange with every peer (its own buffer, copied out once
// every contribution arrived); above, Gloo's ring of n - 1 rounds. Both give every rank's bytes in rank order,
// at the bound and one byte past it, publicly (the shape first: one round more) and with the sizes agreed.
TEST_CASE("allgather: one exchange up to 1 MiB received per rank, the ring above") {
  auto comm = connect("allgather-direct");
  const size_t n = static_cast<size_t>(comm->size());
  if (n < 2) return;
  const size_t largest_direct = (size_t{1} << 20) / (n - 1);
  using Sizes = GlooCommunicator::Sizes;
  for (size_t bytes : {size_t{8}, largest_direct, largest_direct + 1}) {
    for (Sizes sizes : {Sizes::Unknown, Sizes::Agreed}) {
      std::vector<uint8_t> in(bytes), out(bytes * n, 0xEE);
      for (size_t i = 0; i < bytes; ++i) in[i] = static_cast<uint8_t>(i * 7 + 13 * static_cast<size_t>(comm->rank()));
      const uint64_t before = comm->communication_rounds();
      comm->allgather_async(in.data(), out.data(), bytes, sizes).wait();
      const uint64_t rounds = comm->communication_rounds() - before;
      size_t wrong = 0;
      for (size_t r = 0; r < n; ++r)
        for (size_t i = 0; i < bytes; ++i) wrong += out[r * bytes + i] != static_cast<uint8_t>(i * 7 + 13 * r);
      INFO("bytes ", bytes, (sizes == Sizes::Agreed ? ", sizes agreed" : ", public"));
      CHECK(wrong == 0);
      CHECK(rounds == (bytes <= largest_direct ? 1 : n - 1) + (sizes == Sizes::Agreed ? 0 : 1));
    }
  }
}

TEST_CASE("barrier: no rank leaves before the last arrives") {
  auto comm = connect("barrier");
  // The last rank arrives late. Every rank shares this host's CLOCK_REALTIME, so
  // each compares the moment it left against the moment the last rank entered
  // (broadcast afterwards): a comparison of events, not of durations that a
  // rank delayed by the scheduler would shorten.
  auto realtime_ns = [] {
    timespec ts{};
    ::clock_gettime(CLOCK_REALTIME, &ts);
    return static_cast<int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
  };
  const int last = comm->size() - 1;
  int64_t last_entered = 0, left = 0;
  if (comm->rank() == last) {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    last_entered = realtime_ns();
  }
  comm->barrier();
  left = realtime_ns();
  comm->broadcast(&last_entered, sizeof last_entered, last);
  CHECK(last_entered > 0);
  CHECK(left >= last_entered);
}

TEST_CASE("async: many operations in flight complete in submission order") {
  auto comm = connect("async");
  size_t n = static_cast<size_t>(comm->size());
  constexpr int kOps = 40;
  // Op pairs on one buffer: allgather into y, then allreduce y. Out of order,
  // the allreduce would sum stale data.
  std::vector<std::vector<float>> in(kOps), y(kOps);
  std::vector<Work> works;
  for (int k = 0; k < kOps; ++k) {
    size_t count = static_cast<size_t>(1 + k * 997);
    in[k].assign(count, static_cast<float>(comm->rank() + k));
    y[k].assign(count * n, -1.0f);
    works.push_back(comm->allgather_async(in[k].data(), y[k].data(), count * sizeof(float)));
    works.push_back(comm->allreduce_async(y[k].data(), y[k].size(), DataType::Float32));
  }
  works.push_back(comm->barrier_async());
  works.back().wait();
  for (auto& w : works) CHECK(w.done());  // the last one done => all earlier ones done
  for (int k = kOps - 1; k >= 0; --k) {
    works[static_cast<size_t>(2 * k + 1)].wait();
    size_t count = in[k].size();
    size_t wrong = 0;
    for (size_t r = 0; r < n; ++r)
      for (size_t i = 0; i < count; ++i)
        wrong += y[k][r * count + i] != static_cast<float>(n) * static_cast<float>(static_cast<int>(r) + k);
    INFO("op ", k);
    CHECK(wrong == 0);
  }
}

// The creation records travel through the store where every rank offers it (PSGD_FINGERPRINT_STORE=1, the
// default), else by Gloo's ring, which a build before the store path makes (as a rank with 0 does here): each
// test below runs every way. `older_rank`: the rank that offers nothing (-1: none; past the world: the last).
struct RecordPath {
  const char* name;
  int older_rank;
  std::string run_id(const char* test) const { return std::string(test) + "-" + std::to_string(older_rank); }
  bool store() const { return older_rank < 0; }
};
constexpr RecordPath kRecordPaths[] = {
    {"store", -1}, {"ring: rank 0 as an older build", 0}, {"ring: the last rank as an older build", 1 << 20}};

// PSGD_FINGERPRINT_STORE for `path` on this rank.
ScopedEnv offer_for(const RecordPath& path) {
  const int rank = std::atoi(std::getenv("RANK")), world = std::atoi(std::getenv("WORLD_SIZE"));
  const bool older = path.older_rank == rank || (path.older_rank >= world && rank == world - 1);
  return ScopedEnv("PSGD_FINGERPRINT_STORE", older ? "0" : "1");
}

TEST_CASE("fingerprint: by the store where every rank offers it, else the ring; each peer's pair as it prints it") {
  for (const RecordPath& path : kRecordPaths) {
    INFO("path: ", std::string(path.name));
    std::unique_ptr<GlooCommunicator> comm;
    {
      const ScopedEnv offer = offer_for(path);
      comm = connect(path.run_id("fingerprint-paths").c_str());
    }
    const int n = comm->size(), me = comm->rank();
    CHECK(comm->fingerprints_from_store() == (n > 1 && path.store()));
    // Each rank's pairs as Gloo prints them; rank r's table must name rank p's pair towards r as p prints it.
    constexpr size_t kWidth = 96;
    std::vector<char> mine(kWidth * static_cast<size_t>(n), '\0'), all(mine.size() * static_cast<size_t>(n));
    for (int p = 0; p < n; ++p)
      if (p != me)
        std::snprintf(mine.data() + kWidth * static_cast<size_t>(p), kWidth, "%s", comm->pair_address(p).c_str());
    comm->allgather(mine.data(), all.data(), mine.size());
    for (int p = 0; p < n; ++p) {
      if (p == me) {
        CHECK(comm->peer_address(p).empty());
        continue;
      }
      const std::string printed(all.data() + mine.size() * static_cast<size_t>(p) + kWidth * static_cast<size_t>(me));
      const auto [ip, port] = transport::split_pair_address(printed);
      INFO("rank ", p, "'s pair towards rank ", me, ": ", printed);
      REQUIRE(port != 0);
      CHECK(comm->peer_address(p) == "[" + ip + "]:" + std::to_string(port));
    }
    comm->barrier();
  }
}

TEST_CASE("fingerprint: a rank with a different ring threshold is named") {
  if (std::atoi(std::getenv("WORLD_SIZE")) < 2) return;
  for (const RecordPath& path : kRecordPaths) {
    INFO("path: ", std::string(path.name));
    const ScopedEnv offer = offer_for(path);
    const ScopedEnv threshold("PSGD_RING_THRESHOLD_BYTES", std::atoi(std::getenv("RANK")) == 1 ? "12345" : "8388608");
    const std::string what = creation_mismatch(path.run_id("fingerprint-threshold").c_str());
    INFO(what);
    CHECK(what.find("rank 1") != std::string::npos);
    CHECK(what.find("PSGD_RING_THRESHOLD_BYTES 12345") != std::string::npos);
  }
}

// A setting that changes how collectives run (the direct bound) differs on rank 1: by the store, every rank
// reads the same records; by the ring they travel by the one allgather. Either way every rank makes one more
// allgather before it throws (so that none closes its pairs, or the store it hosts, while another waits for a
// record): every rank gets the MismatchError naming rank 1, none a PeerError, an IoError or an abort. Last,
// through the store that rank 0 hosts (as under torchrun), whose own read of the records is a loopback round
// trip (once per process, at its end: the store on MASTER_PORT closes with rank 0's communicator, so a rank
// that went on to another would meet it closing).
TEST_CASE("fingerprint: a rank with another direct bound is named on every rank") {
  if (std::atoi(std::getenv("WORLD_SIZE")) < 2) return;
  std::vector<std::pair<RecordPath, bool>> runs;
  for (const RecordPath& path : kRecordPaths) runs.emplace_back(path, false);
  runs.emplace_back(kRecordPaths[0], true);
  for (const auto& [path, rank0_hosts] : runs) {
    INFO("path: ", std::string(path.name), rank0_hosts ? ", rank 0 hosts the store" : "");
    const ScopedEnv offer = offer_for(path);
    const ScopedEnv bound("PSGD_DIRECT_MAX_BYTES", std::atoi(std::getenv("RANK")) == 1 ? "0" : "262144");
    std::string what;
    if (rank0_hosts) {
      // MASTER_ADDR/MASTER_PORT: free under powersgd-run, as in "torchrun: rank 0 hosts the store".
      CommOptions o = [] {
        const ScopedEnv hosted("PSGD_STORE_HOSTED", "0");
        return options("fingerprint-direct-rank0");
      }();
      o.run_id = path.run_id("fingerprint-direct-rank0");
      REQUIRE(o.host_store == (o.rank == 0));
      try {
        GlooCommunicator::create(o);
        FAIL_CHECK("expected a MismatchError");
      } catch (const MismatchError& e) {
        what = e.what();
      }
    } else {
      what = creation_mismatch(path.run_id("fingerprint-direct").c_str());
    }
    INFO(what);
    CHECK(what.find("rank 1 has PSGD_DIRECT_MAX_BYTES 0 (rank 0: 262144)") != std::string::npos);
  }
}

TEST_CASE("check_same: names what differs and the first differing rank") {
  auto comm = connect("check-same");
  comm->check_same(42, "layout");
  if (comm->size() < 2) return;
  uint64_t mine = comm->rank() >= comm->size() - 1 ? 7 : 42;
  try {
    comm->check_same(mine, "layout");
    FAIL("expected a MismatchError");
  } catch (const MismatchError& e) {
    std::string what = e.what();
    INFO(what);
    CHECK(what.find("layout") != std::string::npos);
    CHECK(what.find("rank " + std::to_string(comm->size() - 1)) != std::string::npos);
  }
  comm->barrier();  // a mismatch does not break the group
}

TEST_CASE("rendezvous: a rank that never comes gives a timeout") {
  CommOptions o = options("never-comes");
  if (o.world_size < 2 || o.rank == o.world_size - 1) return;  // the last rank stays away
  o.timeout = std::chrono::milliseconds(1500);
  auto start = Clock::now();
  CHECK_THROWS_AS(GlooCommunicator::create(o), TimeoutError);
  auto elapsed = Clock::now() - start;
  CHECK(elapsed >= std::chrono::milliseconds(1400));
  CHECK(elapsed < std::chrono::seconds(15));
}

namespace {

// An allreduce of `count` floats with `algorithm` pending when the last rank exits: every survivor fails within a
// second, and the group stays broken.
// The bound pinned at 256 KiB (not auto, which a loaded machine may measure at 1 MiB): the large scatter-gather
// cases must take the path without the receives posted ahead.
// The failure cases' operation: an allreduce of `data`, a lead exchange carrying it, or an allgather of its bytes
// (with the sizes agreed, as the engine's reports: the direct allgather where they come to at most 1 MiB).
enum class Pending { Allreduce, Lead, Allgather };
constexpr uint8_t kUngathered = 0xEE;
std::vector<uint8_t>& gathered() {
  static std::vector<uint8_t> out;
  return out;
}
Work pending_operation(GlooCommunicator& comm, std::vector<float>& data, Algorithm algorithm, Pending kind) {
  static double one_lead[8] = {};
  static std::vector<double> leads;
  static bool summed = false;
  if (kind == Pending::Allreduce) return comm.allreduce_async(data.data(), data.size(), DataType::Float32, algorithm);
  if (kind == Pending::Allgather) {
    const size_t bytes = data.size() * sizeof(float);
    gathered().assign(bytes * static_cast<size_t>(comm.size()), kUngathered);
    return comm.allgather_async(data.data(), gathered().data(), bytes, GlooCommunicator::Sizes::Agreed);
  }
  leads.assign(8 * static_cast<size_t>(comm.size()), 0.0);
  return comm.lead_exchange_async(one_lead, leads.data(), sizeof(one_lead), data.data(), data.size(), DataType::Float32,
                                  &summed);
}
const char* operation_name(Pending kind) {
  return kind == Pending::Lead ? "lead exchange" : kind == Pending::Allgather ? "allgather" : "allreduce";
}
// A failed allgather leaves its output as it was.
bool gathered_untouched() {
  return std::all_of(gathered().begin(), gathered().end(), [](uint8_t b) { return b == kUngathered; });
}

// `kind`: the pending operation (pending_operation).
void killed_peer_case(const char* run_id, Algorithm algorithm, size_t count, Pending kind = Pending::Allreduce) {
  setenv("PSGD_DIRECT_MAX_BYTES", "262144", 1);
  auto comm = connect(run_id);
  unsetenv("PSGD_DIRECT_MAX_BYTES");
  if (comm->size() < 2) return;
  int victim = comm->size() - 1;
  comm->barrier();
  if (comm->rank() == victim) {
    // Exiting without cleanup closes the sockets exactly as SIGKILL would, and
    // exit status 0 keeps the launcher from cancelling the job.
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    _exit(0);
  }
  std::vector<float> data(count, 1.0f);
  auto start = Clock::now();
  try {
    // Pending when the victim dies.
    pending_operation(*comm, data, algorithm, kind).wait();
    FAIL("expected a PeerError");
  } catch (const PeerError& e) {
    auto elapsed = Clock::now() - start;
    MESSAGE(std::string(e.what()));
    CHECK(e.code() == ErrorCode::Io);
    CHECK(e.operation().find(operation_name(kind)) == 0);
    if (kind == Pending::Allgather) CHECK(gathered_untouched());
    CHECK(e.peer() >= 0);
    CHECK(e.peer() != comm->rank());
    if (comm->size() == 2) CHECK(e.peer() == victim);
    CHECK(elapsed < std::chrono::milliseconds(1200) + kSanitizerSlack);  // 200 ms of it the victim's sleep
  }
  // The group is broken: the next operation fails at once with the same error.
  auto start2 = Clock::now();
  CHECK_THROWS_AS(comm->barrier(), PeerError);
  CHECK(Clock::now() - start2 < std::chrono::milliseconds(50));
  // Destruction with a dead peer does not hang (the test's timeout would catch it).
}

// The same with the last rank stopped (SIGSTOP) for longer than the 1 s timeout.
void stopped_peer_case(const char* run_id, Algorithm algorithm, size_t count, Pending kind = Pending::Allreduce) {
  CommOptions o = options(run_id);
  if (o.world_size < 2) return;
  o.timeout = std::chrono::milliseconds(1000);
  setenv("PSGD_DIRECT_MAX_BYTES", "262144", 1);  // as killed_peer_case
  auto comm = GlooCommunicator::create(o);
  unsetenv("PSGD_DIRECT_MAX_BYTES");
  int victim = comm->size() - 1;
  comm->barrier();
  if (comm->rank() == victim) {
    const pid_t child = stop_with_watchdog(std::chrono::seconds(3));
    // Its peers closed their connections meanwhile: its next operation fails.
    CHECK_THROWS_AS(comm->barrier(), PeerError);
    waitpid(child, nullptr, 0);
    return;
  }
  std::vector<float> data(count, 1.0f);
  auto start = Clock::now();
  try {
    pending_operation(*comm, data, algorithm, kind).wait();
    FAIL("expected a PeerError");
  } catch (const PeerError& e) {
    auto elapsed = Clock::now() - start;
    MESSAGE(std::string(e.what()));
    CHECK(e.operation().find(operation_name(kind)) == 0);
    if (kind == Pending::Allgather) CHECK(gathered_untouched());
    // Ranks that talk to the victim time out; the others see them close.
    if (comm->size() == 2) CHECK(e.code() == ErrorCode::Timeout);
    // A timeout never blames another survivor (one that timed out first and closed its pairs).
    if (e.code() == ErrorCode::Timeout) CHECK((e.peer() == victim || e.peer() == -1));
    CHECK(elapsed >= std::chrono::milliseconds(900));
    CHECK(elapsed < std::chrono::seconds(5));
  }
}

}  // namespace

TEST_CASE("failure: a killed peer makes every survivor fail within a second") {
  killed_peer_case("killed", Algorithm::Auto, 4096);
}

TEST_CASE("failure: a lead exchange with a killed peer makes every survivor fail within a second") {
  killed_peer_case("killed-lead", Algorithm::Auto, 4096, Pending::Lead);
}

TEST_CASE("failure: a direct allgather with a killed peer makes every survivor fail within a second") {
  killed_peer_case("killed-allgather", Algorithm::Auto, 4096, Pending::Allgather);
}

TEST_CASE("failure: a direct allgather with a stopped peer gives a timeout after the configured time") {
  stopped_peer_case("stopped-allgather", Algorithm::Auto, 4096, Pending::Allgather);
}

TEST_CASE("failure: a lead exchange with a stopped peer gives a timeout after the configured time") {
  stopped_peer_case("stopped-lead", Algorithm::Auto, 4096, Pending::Lead);
}

TEST_CASE("failure: a stopped peer gives a timeout after the configured time") {
  stopped_peer_case("stopped", Algorithm::Auto, 4096);
}

// Scatter-gather: the first exchange into the receives posted ahead (4096 floats: every chunk fits them), and
// not (300,000 floats, 1.2 MB: chunks of 1.2 MB / n, more than the capacity per peer of a 256 KiB bound on 2 to 5
// ranks).
TEST_CASE("failure: scatter-gather with a killed peer makes every survivor fail within a second") {
  killed_peer_case("killed-sg", Algorithm::ScatterGather, 4096);
}

TEST_CASE("failure: scatter-gather of a large buffer with a killed peer makes every survivor fail within a second") {
  killed_peer_case("killed-sg-large", Algorithm::ScatterGather, 300000);
}

TEST_CASE("failure: scatter-gather with a stopped peer gives a timeout after the configured time") {
  stopped_peer_case("stopped-sg", Algorithm::ScatterGather, 300000);
}

// ---- host-staged allreduce (PSGD_HOST_STAGE=1): Meson's PSGD_TEST_HOSTS splits the loopback ranks into
// pretend hosts (support/doctest_main.hpp sets each rank's PSGD_HOST_ID) ----

namespace {

// The hosts of PSGD_TEST_HOSTS as the communicator must group them: ordered by their lowest rank, ranks ascending.
std::vector<std::vector<int>> test_hosts() {
  std::vector<std::string> names;
  std::vector<std::vector<int>> hosts;
  const auto per_rank = testing::pretend_hosts();
  for (size_t r = 0; r < per_rank.size(); ++r) {
    const size_t h = static_cast<size_t>(std::find(names.begin(), names.end(), per_rank[r]) - names.begin());
    if (h == names.size()) {
      names.push_back(per_rank[r]);
      hosts.emplace_back();
    }
    hosts[h].push_back(static_cast<int>(r));
  }
  return hosts;
}

// The last host with two ranks or more (at least two hosts in all): it is the victim's or odd rank's host.
const std::vector<int>& last_shared_host(const std::vector<std::vector<int>>& hosts) {
  REQUIRE(hosts.size() >= 2);
  for (auto host = hosts.rbegin(); host != hosts.rend(); ++host)
    if (host->size() >= 2) return *host;
  FAIL("no host has two ranks");
  return hosts.front();
}

// Whether PSGD_HOST_SHM lets this rank's hops go through shared memory (the Meson entries of the TCP hops set 0).
bool shm_expected() {
  const char* value = std::getenv("PSGD_HOST_SHM");
  return value == nullptr || std::string(value) != "0";
}

// The pretend host of this rank (RANK).
std::vector<int> my_test_host() {
  const int rank = std::atoi(std::getenv("RANK"));
  for (const auto& host : test_hosts())
    if (std::find(host.begin(), host.end(), rank) != host.end()) return host;
  return {};
}

// A staged communicator (the test's hosts are not degenerate), with the settings restored after creation.
std::unique_ptr<GlooCommunicator> connect_staged(const char* run_id,
                                                 std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  setenv("PSGD_HOST_STAGE", "1", 1);
  CommOptions o = options(run_id);
  o.timeout = timeout;
  auto comm = GlooCommunicator::create(o);
  unsetenv("PSGD_HOST_STAGE");
  REQUIRE(comm->staged_hosts() == static_cast<int>(test_hosts().size()));
  // The pretend hosts share one machine: their hops go through shared memory unless PSGD_HOST_SHM=0.
  CHECK(comm->host_shared_memory() == (shm_expected() && my_test_host().size() >= 2));
  return comm;
}

// Rank r's element i: fractions, so that sums round in every type.
double staged_input(int rank, size_t i) {
  return static_cast<double>((i * 31 + static_cast<size_t>(rank) * 17) % 101 + 1) / (7.0 + rank);
}

// `v` rounded to `type` (a sum of two values of the type, computed in double, rounds as the type's own addition:
// double has more than twice the digits of float32, float32 of float16 and bfloat16).
double round_to(DataType type, double v) {
  Buffer b(type, 1);
  b.set(0, v);
  return b.get(0);
}

// Element i of the sum of every rank's staged_input, each addition rounded to `type`: within each group in
// order, then the groups in order. The staged order for the hosts (test_hosts()); rank order for one rank per
// group.
double ordered_sum(DataType type, const std::vector<std::vector<int>>& groups, size_t i) {
  double total = 0;
  for (size_t k = 0; k < groups.size(); ++k) {
    double partial = round_to(type, staged_input(groups[k][0], i));
    for (size_t j = 1; j < groups[k].size(); ++j)
      partial = round_to(type, partial + round_to(type, staged_input(groups[k][j], i)));
    total = k == 0 ? partial : round_to(type, total + partial);
  }
  return total;
}

uint64_t fnv1a(const std::vector<uint8_t>& bytes) {
  uint64_t h = 1469598103934665603ull;
  for (uint8_t b : bytes) h = (h ^ b) * 1099511628211ull;
  return h;
}

// Rounds of an allreduce among h participants (Gloo's radix-2 bcube: a step per factor 2 and one for the rest).
uint64_t expected_rounds(Algorithm algorithm, uint64_t h) {
  if (algorithm == Algorithm::Direct) return 1;
  if (algorithm == Algorithm::ScatterGather) return 2;
  if (algorithm == Algorithm::Ring) return 2 * (h - 1);
  uint64_t steps = 0;
  for (uint64_t m = h; m > 1; m = m % 2 == 0 ? m / 2 : 1) ++steps;
  return 2 * steps;
}

}  // namespace

TEST_CASE("host stage: sums in the documented order, the same bits on every rank, rounds count hosts") {
  const auto hosts = test_hosts();
  REQUIRE(hosts.size() >= 2);  // the Meson entry sets PSGD_TEST_HOSTS
  // Small thresholds: the leaders run direct, scatter-gather and ring among sizes that stay quick.
  setenv("PSGD_RING_THRESHOLD_BYTES", "65536", 1);
  setenv("PSGD_DIRECT_MAX_BYTES", "4096", 1);
  auto comm = connect_staged("host-stage");
  unsetenv("PSGD_RING_THRESHOLD_BYTES");
  unsetenv("PSGD_DIRECT_MAX_BYTES");
  const auto h = static_cast<uint64_t>(hosts.size());
  const size_t world = static_cast<size_t>(comm->size());
  int direct = 0, scatter_gather = 0, ring = 0;
  for (DataType type : kTypes)
    for (size_t count : {size_t{1}, size_t{7}, size_t{1000}, size_t{5000}, size_t{65537}, size_t{300001}}) {
      const size_t bytes = count * size_of(type);
      const Algorithm expected = bytes >= 65536                 ? Algorithm::Ring
                                 : bytes * (h - 1) <= 4096 ? Algorithm::Direct
                                                           : Algorithm::ScatterGather;
      INFO(to_string(type), " count ", count, " among the leaders ", to_string(expected));
      CHECK(comm->choose(bytes) == expected);
      (expected == Algorithm::Direct ? direct : expected == Algorithm::Ring ? ring : scatter_gather) += 1;
      Buffer b(type, count);
      for (size_t i = 0; i < count; ++i) b.set(i, staged_input(comm->rank(), i));
      const uint64_t before = comm->communication_rounds();
      // Sizes agreed (as the engine's): the algorithm's rounds alone, without a public call's shape where the
      // leaders' algorithm runs beyond the receives posted ahead.
      comm->allreduce_async(b.bytes.data(), count, type, Algorithm::Auto, GlooCommunicator::Sizes::Agreed).wait();
      CHECK(comm->communication_rounds() - before == expected_rounds(expected, h));
      // Every rank holds the same bits.
      const uint64_t mine = fnv1a(b.bytes);
      std::vector<uint64_t> all(world);
      comm->allgather(&mine, all.data(), sizeof(mine));
      CHECK(std::count(all.begin(), all.end(), mine) == static_cast<long>(world));
      size_t wrong = 0;
      for (size_t i = 0; i < count; ++i) {
        if (expected != Algorithm::Ring) {
          // The documented order: within each host in rank order, then the hosts in order (direct or
          // scatter-gather among the leaders).
          Buffer reference(type, 1);
          reference.set(0, ordered_sum(type, hosts, i));
          wrong += std::memcmp(reference.bytes.data(), b.bytes.data() + i * size_of(type), size_of(type)) != 0;
        } else {
          double exact = 0;
          for (size_t r = 0; r < world; ++r) exact += round_to(type, staged_input(static_cast<int>(r), i));
          const double tolerance = type == DataType::Float64 ? 1e-12 : type == DataType::Float32 ? 1e-5 : 3e-2;
          wrong += std::abs(b.get(i) - exact) > tolerance * exact;
        }
      }
      CHECK(wrong == 0);
    }
  CHECK(direct > 0);
  CHECK(scatter_gather > 0);
  CHECK(ring > 0);
  // The sums the engine fuses: layout-independent where the leaders run direct or scatter-gather, not the ring.
  CHECK(comm->sums_in_rank_order(1, DataType::Float32));
  CHECK(comm->sums_in_rank_order(16000, DataType::Float32));
  CHECK_FALSE(comm->sums_in_rank_order(16384, DataType::Float32));
  // allreduce_in_rank_order_async: staged with direct or scatter-gather among the leaders at any size; its
  // elements are the bits of separate allreduces of each part (layout-independent).
  std::vector<float> joined(3000), part_a(1000), part_b(2000);
  for (size_t i = 0; i < joined.size(); ++i) {
    joined[i] = static_cast<float>(staged_input(comm->rank(), i));
    (i < 1000 ? part_a[i] : part_b[i - 1000]) = joined[i];
  }
  const uint64_t before = comm->communication_rounds();
  comm->allreduce_in_rank_order_async(joined.data(), joined.size(), DataType::Float32).wait();
  // Plus the public call's shape (one round): its chunks (12000 bytes over h) are beyond the leaders' receives
  // posted ahead (PSGD_DIRECT_MAX_BYTES=4096), where no header is read first.
  CHECK(comm->communication_rounds() - before == expected_rounds(comm->choose_in_rank_order(12000), h) + 1);
  comm->allreduce_async(part_a.data(), part_a.size(), DataType::Float32, Algorithm::Direct).wait();
  comm->allreduce_async(part_b.data(), part_b.size(), DataType::Float32, Algorithm::Direct).wait();
  CHECK(std::memcmp(joined.data(), part_a.data(), part_a.size() * sizeof(float)) == 0);
  CHECK(std::memcmp(joined.data() + 1000, part_b.data(), part_b.size() * sizeof(float)) == 0);
  // The barrier is the shapes' exchange, staged: the leaders' one round.
  const uint64_t before_barrier = comm->communication_rounds();
  comm->barrier();
  CHECK(comm->communication_rounds() - before_barrier == 1);
}

namespace {

// An allreduce of 1000 float32 (direct), its bits checked against the staged order (test_hosts()) or rank order.
void check_sum_order(GlooCommunicator& comm, bool staged) {
  std::vector<float> data(1000);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<float>(staged_input(comm.rank(), i));
  comm.allreduce(data.data(), data.size(), DataType::Float32);
  std::vector<std::vector<int>> groups = test_hosts();
  if (!staged) {
    groups.clear();
    for (int r = 0; r < comm.size(); ++r) groups.push_back({r});
  }
  size_t wrong = 0;
  for (size_t i = 0; i < data.size(); ++i)
    wrong += static_cast<float>(ordered_sum(DataType::Float32, groups, i)) != data[i];
  INFO("staged ", staged);
  CHECK(wrong == 0);
}

}  // namespace

TEST_CASE("host stage: auto (the default) stages where ranks share a host; 0 leaves it off; legacy API: off") {
  const auto hosts = test_hosts();
  REQUIRE(hosts.size() >= 2);  // the Meson entry sets PSGD_TEST_HOSTS
  unsetenv("PSGD_HOST_STAGE");
  {
    auto comm = connect("host-stage-auto");
    REQUIRE(comm->staged_hosts() == static_cast<int>(hosts.size()));
    check_sum_order(*comm, true);
  }
  setenv("PSGD_HOST_STAGE", "0", 1);
  {
    auto comm = connect("host-stage-off");
    CHECK(comm->staged_hosts() == 0);
    check_sum_order(*comm, false);
  }
  setenv("PSGD_HOST_STAGE", "auto", 1);
  {
    auto comm = connect("host-stage-auto-legacy", GlooApi::Legacy);  // PSGD_HOST_STAGE=1 is refused there
    CHECK(comm->staged_hosts() == 0);
    check_allreduce(*comm, DataType::Float32, 1001, Algorithm::Auto);
    leave_together(*comm, "host-stage-auto-legacy-left");
  }
  unsetenv("PSGD_HOST_STAGE");
}

// PSGD_HOST_SHM=0 on one rank of a shared host: that host's hops go over TCP, the other hosts' through shared
// memory; the bits are the documented order's either way (the hops carry the same bytes).
TEST_CASE("host stage: PSGD_HOST_SHM=0 on one rank keeps its host on TCP, the sums' bits the same") {
  const auto hosts = test_hosts();
  const std::vector<int>& odd_host = last_shared_host(hosts);
  const int rank = std::atoi(std::getenv("RANK"));
  if (rank == odd_host.back()) setenv("PSGD_HOST_SHM", "0", 1);
  auto comm = connect("host-stage-shm-mixed");
  unsetenv("PSGD_HOST_SHM");
  REQUIRE(comm->staged_hosts() == static_cast<int>(hosts.size()));
  const std::vector<int> mine = my_test_host();
  CHECK(comm->host_shared_memory() == (mine.size() >= 2 && mine != odd_host));
  check_sum_order(*comm, true);
  leave_together(*comm, "host-stage-shm-mixed-left");
}

// With PSGD_HOST_STAGE=1 the check at creation (check_world_fits_host) already counts the leaders' context for
// every peer, so a limit that passes it leaves room for it: only auto can meet a leader short of descriptors.
TEST_CASE("host stage: a leader short of file descriptors: auto leaves staging off on every rank") {
  const auto hosts = test_hosts();
  const int victim = last_shared_host(hosts).front();  // a leader, not rank 0 (which also hosts the store)
  const int rank = std::atoi(std::getenv("RANK"));
  const int world = comm_world();
  REQUIRE(victim != 0);
  rlimit original{};
  REQUIRE(::getrlimit(RLIMIT_NOFILE, &original) == 0);
  // The descriptors an unstaged communicator holds once created (its pairs, its store client, Gloo's loop): two
  // per peer here, as the first check counts them. Not fewer: once, under a full suite's load, a count of
  // /proc/self/fd found half of them (5 of 10 on 6 ranks), which raised the limit below past its purpose.
  setenv("PSGD_HOST_STAGE", "0", 1);
  size_t held = 0;
  {
    const size_t before = open_descriptor_count();
    auto comm = connect("host-stage-fd-measure");
    held = std::max<size_t>(open_descriptor_count() - before, 2 * static_cast<size_t>(world - 1));
  }
  // The victim's limit admits creation (Gloo's two per peer and the reserve, as checked first) and leaves it
  // fewer than its leaders' context needs once connected (none spare where the first check allows it: a
  // descriptor more or less than measured changes nothing).
  const uint64_t reserve = 64, first_check = 2 * static_cast<uint64_t>(world - 1) + reserve;
  rlimit lowered = original;
  if (rank == victim) {
    const uint64_t open = open_descriptor_count();
    lowered.rlim_cur = static_cast<rlim_t>(open + std::max<uint64_t>(first_check, held + reserve));
    const uint64_t spare = lowered.rlim_cur - open - held - reserve;
    INFO("open ", open, ", held by a communicator ", held, ", spare ", spare);
    REQUIRE(spare < transport::leader_descriptors(hosts.size()));
    REQUIRE(::setrlimit(RLIMIT_NOFILE, &lowered) == 0);
  }
  setenv("PSGD_HOST_STAGE", "auto", 1);
  {
    auto comm = connect("host-stage-fd-auto");
    CHECK(comm->staged_hosts() == 0);
    check_sum_order(*comm, false);
  }
  unsetenv("PSGD_HOST_STAGE");
  if (rank == victim) REQUIRE(::setrlimit(RLIMIT_NOFILE, &original) == 0);
  // With the limit back, auto stages again.
  auto comm = connect("host-stage-fd-restored");
  CHECK(comm->staged_hosts() == static_cast<int>(hosts.size()));
}

// The lead exchange staged: the same cases as without staging, the capacity that of the leaders' exchange
// shared by the largest host's leads.
TEST_CASE("host stage: the lead exchange sums with the staged bits only where every rank passed it alike") {
  const auto hosts = test_hosts();
  REQUIRE(hosts.size() >= 2);
  setenv("PSGD_DIRECT_MAX_BYTES", "65536", 1);
  auto comm = connect_staged("host-stage-lead");
  unsetenv("PSGD_DIRECT_MAX_BYTES");
  size_t largest = 0;
  for (const auto& host : hosts) largest = std::max(largest, host.size());
  const size_t leaders = 65536 / (hosts.size() - 1) / 64 * 64 - 8;
  lead_exchange_cases(comm.get(), (leaders - 8) / largest / 64 * 64);
  // One round: the leaders' exchange.
  std::vector<double> lead(2, 1.0), leads(2 * static_cast<size_t>(comm->size()));
  std::vector<float> x(100, 1.0f);
  bool summed = false;
  const uint64_t before = comm->communication_rounds();
  comm->lead_exchange_async(lead.data(), leads.data(), 16, x.data(), x.size(), DataType::Float32, &summed).wait();
  CHECK(comm->communication_rounds() - before == 1);
  CHECK(summed);
  CHECK(x[99] == static_cast<float>(comm->size()));
}

// A rank of a host (not its leader), a host's leader, rank 0, the last host's leader (alone on its host in
// n5/n6) and two hosts at once in turn pass a lead of another size, then a lead where the others send a shape:
// every rank gets a MismatchError, and the next lead exchange pairs as usual.
TEST_CASE("host stage: a lead of another size or kind on a member or a leader gives a MismatchError on every rank") {
  const auto hosts = test_hosts();
  const int member = last_shared_host(hosts).back();
  auto comm = connect_staged("host-stage-lead-mismatch", std::chrono::seconds(20));
  const int n = comm->size(), me = comm->rank();
  std::vector<double> lead(4, 1.0 + me), leads(4 * static_cast<size_t>(n));
  std::vector<float> x(5, 1.0f);
  const int last_leader = hosts.back().front();
  const std::vector<std::vector<int>> odd_sets = {{member}, {hosts[1].front()}, {0}, {last_leader}, {0, last_leader}};
  for (const std::vector<int>& odd : odd_sets) {
    CAPTURE(odd.back());
    const bool is_odd = std::find(odd.begin(), odd.end(), me) != odd.end();
    const std::vector<float> before = x;
    bool summed = false;
    try {
      comm->lead_exchange_async(lead.data(), leads.data(), is_odd ? 3 * sizeof(double) : 4 * sizeof(double),
                                x.data(), x.size(), DataType::Float32, &summed)
          .wait();
      FAIL("expected a MismatchError");
    } catch (const MismatchError& e) {
      const std::string what = e.what();
      INFO(what);
      CHECK(what.find("lead exchange: ") == 0);
      CHECK(what.find("every rank must pass the same lead") != std::string::npos);
    }
    CHECK(x == before);
    comm->barrier();
    comm->lead_exchange_async(lead.data(), leads.data(), 4 * sizeof(double), x.data(), x.size(), DataType::Float32,
                              &summed)
        .wait();
    CHECK(summed);
    CHECK(x[4] == static_cast<float>(n));
    std::fill(x.begin(), x.end(), 1.0f);
    for (int r = 0; r < n; ++r) CHECK(leads[4 * static_cast<size_t>(r) + 3] == 1.0 + r);
  }
  // The same ranks in turn pass a lead (a shape's 24 bytes, then 32) where the others' broadcast sends its shape:
  // every rank gets a MismatchError naming the same rank (kind_mismatch_message); no lead arrives; the group goes
  // on.
  for (const size_t lead_bytes : {size_t{24}, size_t{32}})
    for (const std::vector<int>& odd : odd_sets) {
      const auto is_odd = [&](int r) { return std::find(odd.begin(), odd.end(), r) != odd.end(); };
      CAPTURE(lead_bytes);
      CAPTURE(odd.back());
      std::vector<uint64_t> mine(lead_bytes / 8, 7), all(lead_bytes / 8 * static_cast<size_t>(n), 0);
      std::vector<uint8_t> bytes(16, 1);
      bool summed = true;
      try {
        if (is_odd(me))
          comm->lead_exchange_async(mine.data(), all.data(), lead_bytes, nullptr, 0, DataType::Float32, &summed)
              .wait();
        else
          comm->broadcast(bytes.data(), bytes.size(), 0);
        FAIL("expected a MismatchError");
      } catch (const MismatchError& e) {
        const std::string what = e.what();
        INFO(what);
        const std::string expected = kind_mismatch_message(hosts, n, me, lead_bytes, is_odd);
        CHECK(what == (is_odd(me) ? expected : "broadcast of 16 bytes from root 0, its shape sent first: " + expected));
      }
      CHECK(std::count(all.begin(), all.end(), 0) == static_cast<long>(all.size()));
      CHECK(std::count(bytes.begin(), bytes.end(), 1) == 16);
      comm->barrier();
      comm->broadcast(bytes.data(), bytes.size(), 0);
    }
}

// Ranks that pass another count or type to a staged allreduce (a direct caller's error; the engine compares
// sizes first): no process aborts (Gloo does on a message longer than its receive), no rank waits out its 60 s
// timeout, and the group breaks at once. Odd ranks in turn, each on a new group:
//  - the last host's ranks, one element more: every leader's algorithm finds the mismatch; every rank gets a
//    MismatchError, no rank that is not a leader has its data changed;
//  - on the largest host (3 ranks in n6, so that buffers sit at several offsets): its last rank one element
//    more, one fewer, the same bytes as float16; its leader one more. That host's ranks get a MismatchError
//    naming the odd rank's and the leader's sizes, their data unchanged; every other rank a PeerError (their
//    leaders wait for the odd host's leader, which breaks the group).
// Every rank's data differs (1 + rank), so a buffer sent back to the wrong rank shows. Then the next allreduce,
// alike on every rank, fails at once: the group is broken.
TEST_CASE("host stage: counts that differ fail every rank at once, nothing aborts, the group broken") {
  const auto hosts = test_hosts();
  const std::vector<int>* largest = &hosts.front();
  for (const auto& host : hosts)
    if (host.size() > largest->size()) largest = &host;
  const std::vector<int>& odd_host = *largest;
  REQUIRE(odd_host.size() >= 2);
  struct Case {
    const char* what;
    std::vector<int> odd;
    int extra;     // elements the odd ranks pass beyond the others' 100 float32
    bool as_half;  // the odd ranks pass the same bytes as float16
    bool between_hosts;
  };
  const Case cases[] = {{"between-hosts", hosts.back(), 1, false, true},
                        {"member-longer", {odd_host.back()}, 1, false, false},
                        {"member-shorter", {odd_host.back()}, -1, false, false},
                        {"member-half", {odd_host.back()}, 0, true, false},
                        {"leader-longer", {odd_host.front()}, 1, false, false}};
  for (const Case& c : cases) {
    INFO(c.what);
    auto comm = connect_staged(detail::concat("host-stage-count-mismatch-", c.what).c_str());
    const int me = comm->rank();
    const bool odd = std::find(c.odd.begin(), c.odd.end(), me) != c.odd.end();
    const bool on_odd_host = std::find(odd_host.begin(), odd_host.end(), me) != odd_host.end();
    bool leader = false;
    for (const auto& host : hosts) leader = leader || host.front() == me;
    const float mine = static_cast<float>(1 + me);
    std::vector<float> x(static_cast<size_t>(100 + (odd ? c.extra : 0)), mine);
    const bool half = odd && c.as_half;
    comm->barrier();
    const auto start = Clock::now();
    try {
      comm->allreduce_async(x.data(), half ? 2 * x.size() : x.size(), half ? DataType::Float16 : DataType::Float32,
                            Algorithm::Direct)
          .wait();
      FAIL("expected a failure");
    } catch (const MismatchError& e) {
      const std::string what = e.what();
      INFO(what);
      CHECK((c.between_hosts || on_odd_host));
      CHECK(what.find("the group is broken") != std::string::npos);
      if (!c.between_hosts) {
        CHECK(what.find(detail::concat("allreduce: rank ", c.odd.front() == odd_host.front() ? odd_host[1] : c.odd.front(),
                                       " passed ")) == 0);
        CHECK(what.find(detail::concat("its host's leader, rank ", odd_host.front(), ", passed ")) != std::string::npos);
      }
      if (c.between_hosts) {
        std::string leaders;
        for (const auto& host : hosts) leaders += detail::concat(leaders.empty() ? "" : ", ", host.front());
        CHECK(what.find(leader ? detail::concat("where rank k is host k's leader: ranks ", leaders, ")")
                               : std::string("allreduce: the hosts' leaders passed different counts or types")) !=
              std::string::npos);
      }
      if (!leader || !c.between_hosts)
        CHECK(std::all_of(x.begin(), x.end(), [&](float v) { return v == mine; }));
    } catch (const PeerError& e) {
      INFO(std::string(e.what()));
      CHECK((!c.between_hosts && !on_odd_host));
    }
    CHECK(Clock::now() - start < std::chrono::seconds(10) + kSanitizerSlack);
    std::vector<float> alike(100, 1.0f);
    const auto again = Clock::now();
    CHECK_THROWS(comm->allreduce(alike.data(), alike.size(), DataType::Float32));
    CHECK(Clock::now() - again < std::chrono::seconds(1));
  }
}

TEST_CASE("host stage: a bad PSGD_HOST_STAGE is refused, a mismatched one named at creation on every rank") {
  setenv("PSGD_HOST_STAGE", "yes", 1);
  try {
    connect("host-stage-bad");
    FAIL("expected an InvalidArgumentError");
  } catch (const InvalidArgumentError& e) {
    const std::string what = e.what();
    INFO(what);
    CHECK(what.find("PSGD_HOST_STAGE='yes'") != std::string::npos);
    CHECK(what.find("expected 0 (off), 1 (host-staged allreduce) or auto") != std::string::npos);
  }
  unsetenv("PSGD_HOST_STAGE");
  if (comm_world() < 2) return;
  if (std::atoi(std::getenv("RANK")) == 1) setenv("PSGD_HOST_STAGE", "1", 1);
  try {
    connect("host-stage-mismatch");
    FAIL("expected a MismatchError");
  } catch (const MismatchError& e) {
    const std::string what = e.what();
    INFO(what);
    CHECK(what.find("rank 1 has PSGD_HOST_STAGE 1 (rank 0: auto)") != std::string::npos);
  }
  unsetenv("PSGD_HOST_STAGE");
}

TEST_CASE("host stage: no effect on one host (loopback ranks); refused with the legacy API") {
  setenv("PSGD_HOST_STAGE", "1", 1);
  {
    auto comm = connect("host-stage-one-host");
    CHECK(comm->staged_hosts() == 0);
    const uint64_t before = comm->communication_rounds();
    check_allreduce(*comm, DataType::Float32, 1001, Algorithm::Auto);
    CHECK(comm->communication_rounds() - before == (comm->size() > 1 ? 1 : 0));  // direct over every rank
  }
  if (comm_world() > 1) {
    try {
      connect("host-stage-legacy", GlooApi::Legacy);
      FAIL("expected an UnsupportedError");
    } catch (const UnsupportedError& e) {
      const std::string what = e.what();
      INFO(what);
      CHECK(what.find("PSGD_HOST_STAGE=1 needs Gloo's new API") != std::string::npos);
    }
  }
  unsetenv("PSGD_HOST_STAGE");
}

namespace {

// The staged failure cases' operation: an allreduce of 4096 floats, or (`lead`) a lead exchange carrying 1024.
struct StagedOperation {
  StagedOperation(GlooCommunicator& comm_, bool lead_)
      : comm(comm_), lead(lead_), data(lead_ ? 1024 : 4096, 1.0f), leads(8 * static_cast<size_t>(comm_.size())) {}
  void operator()() {
    // Sizes agreed, as the engine's allreduces: these cases test the hops' own checks and failures, which a
    // public call's shape (sent first) would meet before them.
    if (!lead)
      return comm.allreduce_async(data.data(), data.size(), DataType::Float32, Algorithm::Auto,
                                  GlooCommunicator::Sizes::Agreed)
          .wait();
    comm.lead_exchange_async(one_lead.data(), leads.data(), 8 * sizeof(double), data.data(), data.size(),
                             DataType::Float32, &summed)
        .wait();
  }
  GlooCommunicator& comm;
  bool lead;
  std::vector<float> data;
  std::vector<double> one_lead = std::vector<double>(8, 0.0), leads;
  bool summed = false;
};

// A rank of a staged group exits in the middle of a sequence of allreduces (after its third): every survivor's
// fourth fails with a PeerError within seconds (not its 60 s timeout), and the group is broken.
void staged_exit(bool leader, bool lead = false) {
  const auto hosts = test_hosts();
  const std::vector<int>& host = last_shared_host(hosts);
  const int victim = leader ? host.front() : host.back();
  REQUIRE(victim > 0);  // not rank 0: it would take the test's output with it
  auto comm = connect_staged(lead ? (leader ? "host-stage-lead-leader-exits" : "host-stage-lead-member-exits")
                                  : (leader ? "host-stage-leader-exits" : "host-stage-member-exits"));
  comm->barrier();
  StagedOperation operation(*comm, lead);
  if (comm->rank() == victim) {
    for (int k = 0; k < 3; ++k) operation();
    // The others' fourth allreduces are pending by then. Exiting without cleanup closes the sockets as SIGKILL
    // would, and exit status 0 keeps the launcher from cancelling the job.
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    _exit(0);
  }
  int failed_at = -1;
  for (int k = 0; k < 10 && failed_at < 0; ++k) {
    const auto start = Clock::now();
    try {
      operation();
    } catch (const PeerError& e) {
      failed_at = k;
      MESSAGE(std::string(e.what()));
      CHECK(e.code() == ErrorCode::Io);
      CHECK(e.operation().find(lead ? "lead exchange(64 bytes + 1024 x float32, host-staged)"
                                    : "allreduce(4096 x float32, host-staged") == 0);
      CHECK(Clock::now() - start < std::chrono::seconds(5) + kSanitizerSlack);
    }
  }
  CHECK(failed_at == 3);
  const auto start = Clock::now();
  CHECK_THROWS_AS(comm->allreduce(operation.data.data(), operation.data.size(), DataType::Float32), PeerError);
  CHECK(Clock::now() - start < std::chrono::milliseconds(50));
}

}  // namespace

TEST_CASE("host stage: a leader that exits makes every survivor fail at once") { staged_exit(true); }

TEST_CASE("host stage: a rank that is not a leader exits: every survivor fails at once") { staged_exit(false); }

TEST_CASE("host stage: a leader that exits during lead exchanges makes every survivor fail at once") {
  staged_exit(true, true);
}

TEST_CASE("host stage: a rank that is not a leader exits during lead exchanges: every survivor fails at once") {
  staged_exit(false, true);
}

namespace {

// A rank stopped (SIGSTOP) during an allreduce or a lead exchange (`lead`): a rank that is not a leader, or
// (`leader`) a host's leader, whose host's other ranks and the other leaders wait on it.
void staged_stopped(bool lead, bool leader) {
  const auto hosts = test_hosts();
  const std::vector<int>& host = last_shared_host(hosts);
  const int victim = leader ? host.front() : host.back(), victim_leader = host.front();
  REQUIRE(victim > 0);  // not rank 0: it hosts the store
  const std::string run_id = detail::concat("host-stage-", lead ? "lead-" : "", "stopped", leader ? "-leader" : "");
  auto comm = connect_staged(run_id.c_str(), std::chrono::milliseconds(1000));
  comm->barrier();
  StagedOperation operation(*comm, lead);
  if (comm->rank() == victim) {
    const pid_t child = stop_with_watchdog(std::chrono::seconds(4));
    CHECK_THROWS_AS(operation(), PeerError);
    waitpid(child, nullptr, 0);
    return;
  }
  const auto start = Clock::now();
  try {
    operation();
    FAIL("expected a PeerError");
  } catch (const PeerError& e) {
    const auto elapsed = Clock::now() - start;
    MESSAGE(std::string(e.what()));
    // Only those that wait on the victim itself wait the whole timeout from their own start (a stopped member:
    // its leader); the others fail when one of those does, measured from their own starts, which may be later
    // on a loaded machine. A stopped leader's host's ranks may wait twice: their send, then the reply.
    if (!leader && comm->rank() == victim_leader) CHECK(elapsed >= std::chrono::milliseconds(900));
    CHECK(elapsed < std::chrono::seconds(4));
  }
  if (lead) CHECK(std::all_of(operation.data.begin(), operation.data.end(), [](float v) { return v == 1.0f; }));
}

}  // namespace

TEST_CASE("host stage: a stopped rank makes every survivor fail after the timeout, not later") {
  staged_stopped(false, false);
}

TEST_CASE("host stage: a stopped leader makes every survivor fail after the timeout, not later") {
  staged_stopped(false, true);
}

TEST_CASE("host stage: a rank stopped during a lead exchange makes every survivor fail after the timeout") {
  staged_stopped(true, false);
}

TEST_CASE("host stage: a leader stopped during a lead exchange makes every survivor fail after the timeout") {
  staged_stopped(true, true);
}

// A rank that is not a leader runs a lead exchange where every other rank runs an allreduce of as many bytes
// (callers out of step): the hops within a host of the two operations use slots of their own, so no rank reads
// one's message as the other's (a leader would read the member's header as floats, or a message longer than
// its receive); every rank fails with a PeerError, the member's data as it was: at once through shared memory
// (the leader finds the other slot in the frame), after about the timeout over TCP (PSGD_HOST_SHM=0).
TEST_CASE("host stage: a rank at a lead exchange while the others allreduce: every rank fails, nothing misread") {
  const auto hosts = test_hosts();
  const int member = last_shared_host(hosts).back();
  auto comm = connect_staged("host-stage-out-of-step", std::chrono::milliseconds(1000));
  comm->barrier();
  StagedOperation operation(*comm, comm->rank() == member);
  operation.data.assign(1024, 1.0f);
  const auto start = Clock::now();
  try {
    operation();
    FAIL("expected a PeerError");
  } catch (const PeerError& e) {
    MESSAGE(std::string(e.what()));
    CHECK(Clock::now() - start < std::chrono::seconds(4) + kSanitizerSlack);
  }
  if (comm->rank() == member)
    CHECK(std::all_of(operation.data.begin(), operation.data.end(), [](float v) { return v == 1.0f; }));
}

// A channel (Communicator::create_channel): both groups in flight at once, each from its own thread; every sum
// right; the channel took the first's direct bound (auto), the same on every rank, without measuring it again,
// and the first's settings, not the environment's at the time (which differs on the last rank here).
void two_channels_case(const CommOptions& first_options) {
  std::unique_ptr<GlooCommunicator> first;
  {
    ScopedEnv bound("PSGD_DIRECT_MAX_BYTES", "auto");
    first = GlooCommunicator::create(first_options);
  }
  const uint64_t rounds_at_creation = first->rounds();
  std::unique_ptr<GlooCommunicator> second;
  {
    std::optional<ScopedEnv> other_setting;
    if (first->rank() == first->size() - 1) other_setting.emplace("PSGD_SCATTER_GATHER", "0");
    second = first->create_channel(1);
  }
  REQUIRE(second->size() == first->size());
  REQUIRE(second->rank() == first->rank());
  CHECK(second->options().run_id == first_options.run_id + "/channel1");
  CHECK(second->direct_max_bytes() == first->direct_max_bytes());
  // Every collective of the creation counts (the fingerprint's, the auto bound's); the channel made no measurement.
  CHECK(second->rounds() < rounds_at_creation);
  const uint64_t bound = second->direct_max_bytes();
  std::vector<uint64_t> bounds(static_cast<size_t>(second->size()));
  second->allgather(&bound, bounds.data(), sizeof(bound));
  for (const uint64_t b : bounds) CHECK(b == bound);
  // kCounts twice over (direct, scatter-gather and ring sizes in turn), each channel starting elsewhere in it.
  const auto traffic = [](GlooCommunicator& comm, size_t offset) {
    for (size_t k = 0; k < 2 * std::size(kCounts); ++k)
      check_allreduce(comm, DataType::Float32, kCounts[(k + offset) % std::size(kCounts)], Algorithm::Auto);
  };
  std::thread other([&] { traffic(*second, 3); });
  traffic(*first, 0);
  other.join();
  second->barrier();
  first->barrier();  // where rank 0 hosts the store, it must outlive every rank's rendezvous
}

TEST_CASE("channels: a channel on the first's store, a run id of its own, in flight beside it") {
  two_channels_case(options("channels"));
}

// Ranks that pass different indices rendezvous under different keys: each fails after the timeout, naming the
// ranks that came, and the first communicator stays usable.
TEST_CASE("channels: an index that differs on the last rank fails every rank after the timeout") {
  CommOptions o = options("channels-index");
  o.timeout = std::chrono::milliseconds(4000);  // the channel's too: long enough for the first's creation
  auto first = GlooCommunicator::create(o);
  if (first->size() < 2) return;
  const bool last = first->rank() == first->size() - 1;
  first->barrier();  // every rank at its channel's rendezvous within the timeout
  const auto start = Clock::now();
  try {
    (void)first->create_channel(last ? 2 : 1);
    FAIL("created");
  } catch (const TimeoutError& e) {
    const std::string what = e.what();
    INFO(what);
    CHECK(what.find("timed out after 4000 ms") != std::string::npos);
    // How many came, where the store still answered after the wait (else "fewer than").
    const std::string came = last ? "only 1 of " : "only " + std::to_string(first->size() - 1) + " of ";
    CHECK((what.find(came) != std::string::npos || what.find("fewer than") != std::string::npos));
  }
  CHECK(Clock::now() - start < std::chrono::seconds(10) + kSanitizerSlack);
  first->barrier();
  check_allreduce(*first, DataType::Float32, 1001, Algorithm::Auto);
}

TEST_CASE("channels: the same where rank 0 hosts the store on MASTER_PORT (torchrun)") {
  unsetenv("PSGD_STORE_HOSTED");  // as the torchrun case below: the last case of its process
  const CommOptions o = options("channels-torchrun");
  CHECK(o.host_store == (o.rank == 0));
  two_channels_case(o);
}

TEST_CASE("torchrun: rank 0 hosts the store on MASTER_PORT") {
  // Under powersgd-run, MASTER_ADDR/MASTER_PORT are torch.distributed's (the launcher's store is in
  // PSGD_STORE_ADDR/PSGD_STORE_PORT) and free: without PSGD_STORE_HOSTED rank 0 hosts the store there.
  unsetenv("PSGD_STORE_HOSTED");
  CommOptions o = options("torchrun");
  CHECK(o.host_store == (o.rank == 0));
  CHECK(o.address == "127.0.0.1");
  auto comm = GlooCommunicator::create(o);
  float x = 1.0f;
  comm->allreduce(&x, 1, DataType::Float32);
  CHECK(x == static_cast<float>(comm->size()));
  comm->barrier();  // rank 0's store must outlive everyone's rendezvous
}

TEST_CASE("ibverbs: usable when an RDMA device exists, else a clear error naming the fix") {
  CommOptions o = options("ibverbs");
  o.transport = TransportKind::Ibverbs;
  bool have_device = false;
#if PSGD_HAVE_IBVERBS
  int count = 0;
  if (ibv_device** list = ibv_get_device_list(&count)) {
    have_device = count > 0;
    ibv_free_device_list(list);
  }
#endif
  if (have_device) {
    // Real hardware: the old-style algorithms must give exact sums.
    auto comm = GlooCommunicator::create(o);
    for (size_t count_ : {size_t{1}, size_t{65537}}) check_allreduce(*comm, DataType::Float32, count_, Algorithm::Auto);
  } else {
    try {
      GlooCommunicator::create(o);
      FAIL("expected UnsupportedError without an RDMA device");
    } catch (const UnsupportedError& e) {
      INFO(std::string(e.what()));
      CHECK(std::string(e.what()).find("PSGD_TRANSPORT=tcp") != std::string::npos);
    }
  }
}

TEST_CASE("from_env: validation names the variable and the value") {
  // Single-process checks on a private copy of the environment variables.
  struct Saved {
    std::string name;
    std::optional<std::string> value;
  };
  std::vector<Saved> saved;
  for (const char* name : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PSGD_TRANSPORT", "PSGD_IFACE", "PSGD_ADDR",
                           "PSGD_STORE_HOSTED"}) {
    const char* v = std::getenv(name);
    saved.push_back({name, v ? std::optional<std::string>(v) : std::nullopt});
  }
  unsetenv("PSGD_STORE_HOSTED");  // else powersgd-run's PSGD_STORE_ADDR/PSGD_STORE_PORT win over MASTER_*
  auto expect = [](const char* var, const char* value, const char* needle) {
    const char* old = std::getenv(var);
    std::string keep = old ? old : "";
    setenv(var, value, 1);
    try {
      CommOptions::from_env();
      FAIL("expected InvalidArgumentError for ", var, "=", value);
    } catch (const InvalidArgumentError& e) {
      INFO(std::string(e.what()));
      CHECK(std::string(e.what()).find(needle) != std::string::npos);
    }
    if (old) setenv(var, keep.c_str(), 1); else unsetenv(var);
  };
  setenv("RANK", "0", 1);
  setenv("WORLD_SIZE", "2", 1);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", "29500", 1);
  CHECK(CommOptions::from_env().address == "127.0.0.1");
  expect("RANK", "2", "RANK=2");
  expect("RANK", "x", "RANK='x'");
  expect("WORLD_SIZE", "0", "WORLD_SIZE=0");
  expect("MASTER_PORT", "70000", "MASTER_PORT=70000");
  expect("PSGD_TRANSPORT", "udp", "PSGD_TRANSPORT='udp'");
  setenv("PSGD_IFACE", "lo", 1);
  expect("PSGD_ADDR", "127.0.0.1", "PSGD_IFACE='lo'");
  unsetenv("PSGD_IFACE");
  for (auto& s : saved)
    if (s.value) setenv(s.name.c_str(), s.value->c_str(), 1); else unsetenv(s.name.c_str());
}

int main(int argc, char** argv) {
  if (std::getenv("WORLD_SIZE") == nullptr) {
    std::fprintf(stderr, "test_comm: WORLD_SIZE is not set; run under powersgd-run (skipped)\n");
    return 77;
  }
  return powersgd::testing::run_selected_tests(argc, argv);
}
