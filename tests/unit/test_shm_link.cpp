// transport/comm/shm_link: the shared-memory rings of the hops within a host, between threads of one process
// (also under ThreadSanitizer, suite tsan) and a child process that exits; a full /dev/shm in a private mount
// namespace (root only, else skipped with a message).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "support/doctest_main.hpp"

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <sys/types.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "comm/shm_link.hpp"

using namespace powersgd::transport;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

namespace {

constexpr milliseconds kLong{20000};

std::vector<uint8_t> pattern(size_t bytes, uint8_t seed) {
  std::vector<uint8_t> v(bytes);
  for (size_t i = 0; i < bytes; ++i) v[i] = static_cast<uint8_t>(seed + i * 7 + (i >> 8));
  return v;
}

// A leader's segment for `members` other ranks and each member's mapping of it, all attached (ranks: the
// participant's index).
struct Host {
  explicit Host(size_t members, size_t ring_bytes = 4096) {
    std::string why;
    leader = ShmHostLink::create(members, ring_bytes, why);
    REQUIRE_MESSAGE(leader != nullptr, why);
    leader->attach();
    for (size_t m = 1; m <= members; ++m) {
      auto link = ShmHostLink::open(leader->name(), m, why);
      REQUIRE_MESSAGE(link != nullptr, why);
      link->attach();
      member.push_back(std::move(link));
    }
    leader->unlink();
  }
  std::unique_ptr<ShmHostLink> leader;
  std::vector<std::unique_ptr<ShmHostLink>> member;  // member[m - 1] is participant m
};

}  // namespace

TEST_CASE("shared-memory link: messages of every size both ways, in order, through rings smaller than them") {
  Host host(2);
  const std::vector<size_t> sizes = {0, 1, 4095, 4096, 4097, 100000, 3};
  std::vector<std::thread> members;
  for (size_t m = 1; m <= 2; ++m)
    members.emplace_back([&, m] {
      ShmHostLink& link = *host.member[m - 1];
      for (size_t k = 0; k < sizes.size(); ++k) {
        const auto out = pattern(sizes[k], static_cast<uint8_t>(m * 16 + k));
        link.send(0, 0, 0x50, static_cast<uint32_t>(k), out.data(), out.size(), kLong);
        std::vector<uint8_t> back(sizes[k] + 8, 0xee);
        const size_t got = link.receive(0, 0, 0x51, static_cast<uint32_t>(k), back.data(), back.size(), kLong);
        CHECK(got == sizes[k]);
        back.resize(got);
        auto expected = out;
        for (auto& b : expected) b = static_cast<uint8_t>(b ^ 0x5a);
        CHECK(back == expected);
      }
    });
  // The leader reads member 1's message, then member 2's (member 2 waits for room meanwhile), and answers each.
  for (size_t k = 0; k < sizes.size(); ++k)
    for (size_t m = 1; m <= 2; ++m) {
      std::vector<uint8_t> in(sizes[k]);
      CHECK(host.leader->receive(m, static_cast<int>(m), 0x50, static_cast<uint32_t>(k), in.data(), in.size(),
                                 kLong) == sizes[k]);
      CHECK(in == pattern(sizes[k], static_cast<uint8_t>(m * 16 + k)));
      for (auto& b : in) b = static_cast<uint8_t>(b ^ 0x5a);
      host.leader->send(m, static_cast<int>(m), 0x51, static_cast<uint32_t>(k), in.data(), in.size(), kLong);
    }
  for (auto& t : members) t.join();
  CHECK(host.leader->sees(1));
  CHECK(host.member[1]->sees(0));
}

TEST_CASE("shared-memory link: another slot or tag, or a longer message, fails the receiver naming the peer") {
  Host host(1);
  uint8_t bytes[16] = {};
  host.member[0]->send(0, 0, 0x50, 7, bytes, 4, kLong);
  try {
    host.leader->receive(1, 3, 0x57, 7, bytes, sizeof bytes, kLong);
    FAIL("expected a HostHopError");
  } catch (const HostHopError& e) {
    MESSAGE(std::string(e.what()));
    CHECK(e.peer() == 3);
    CHECK(!e.timeout());
    CHECK(std::string(e.what()).find("out of step: it sent a message of slot 0x50 (operation 7) where this rank "
                                     "expected slot 0x57 (operation 7)") != std::string::npos);
  }
  Host other(1);
  other.member[0]->send(0, 0, 0x50, 8, bytes, 16, kLong);
  try {
    other.leader->receive(1, 1, 0x50, 8, bytes, 10, kLong);
    FAIL("expected a HostHopError");
  } catch (const HostHopError& e) {
    CHECK(std::string(e.what()).find("sent 16 bytes where this rank expected at most 10") != std::string::npos);
  }
}

TEST_CASE("shared-memory link: a peer that closes fails the waiter at once; one that stalls, after the timeout") {
  Host host(1);
  uint8_t byte = 0;
  std::thread closer([&] {
    std::this_thread::sleep_for(milliseconds(100));
    host.member[0]->close();
  });
  auto start = Clock::now();
  try {
    host.leader->receive(1, 5, 0x50, 1, &byte, 1, kLong);
    FAIL("expected a HostHopError");
  } catch (const HostHopError& e) {
    MESSAGE(std::string(e.what()));
    CHECK(!e.timeout());
    CHECK(e.peer() == 5);
    CHECK(std::string(e.what()).find("rank 5 closed its side") != std::string::npos);
  }
  CHECK(Clock::now() - start < std::chrono::seconds(5));
  closer.join();
  // A message the peer sent before it closed is still read.
  Host sent(1);
  sent.member[0]->send(0, 0, 0x50, 1, &byte, 1, kLong);
  sent.member[0]->close();
  CHECK(sent.leader->receive(1, 1, 0x50, 1, &byte, 1, kLong) == 1);
  // Nobody sends: the timeout, no earlier.
  Host idle(1);
  start = Clock::now();
  try {
    idle.member[0]->receive(0, 0, 0x51, 1, &byte, 1, milliseconds(300));
    FAIL("expected a HostHopError");
  } catch (const HostHopError& e) {
    MESSAGE(std::string(e.what()));
    CHECK(e.timeout());
    CHECK(std::string(e.what()).find("Timed out waiting for rank 0") == 0);
  }
  CHECK(Clock::now() - start >= milliseconds(300));
  // A writer whose ring is full waits for room as long, then fails alike.
  std::vector<uint8_t> big(8192);
  try {
    idle.member[0]->send(0, 0, 0x50, 2, big.data(), big.size(), milliseconds(200));
    FAIL("expected a HostHopError");
  } catch (const HostHopError& e) {
    CHECK(e.timeout());
    CHECK(std::string(e.what()).find("room to send") != std::string::npos);
  }
}

TEST_CASE("shared-memory link: a process that exits fails its waiting peer within milliseconds") {
  std::string why;
  auto leader = ShmHostLink::create(1, 4096, why);
  REQUIRE_MESSAGE(leader != nullptr, why);
  leader->attach();
  int ready[2], go[2];
  REQUIRE(::pipe(ready) == 0);
  REQUIRE(::pipe(go) == 0);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    std::string child_why;
    auto link = ShmHostLink::open(leader->name(), 1, child_why);
    if (link != nullptr) link->attach();
    const char mapped = link != nullptr ? 1 : 0;
    if (::write(ready[1], &mapped, 1) != 1) _exit(2);
    char byte = 0;
    if (::read(go[0], &byte, 1) != 1) _exit(2);
    _exit(0);  // no close(): as a crash would leave it
  }
  char mapped = 0;
  REQUIRE(::read(ready[0], &mapped, 1) == 1);
  REQUIRE(mapped == 1);
  leader->unlink();
  CHECK(leader->sees(1));
  REQUIRE(::write(go[1], &mapped, 1) == 1);
  const auto start = Clock::now();
  uint8_t byte = 0;
  try {
    leader->receive(1, 1, 0x50, 1, &byte, 1, kLong);  // the child is not reaped yet: a zombie counts as gone
    FAIL("expected a HostHopError");
  } catch (const HostHopError& e) {
    MESSAGE(std::string(e.what()));
    CHECK(!e.timeout());
    CHECK(std::string(e.what()).find("exited") != std::string::npos);
  }
  CHECK(Clock::now() - start < std::chrono::seconds(3));
  int status = 0;
  ::waitpid(child, &status, 0);
  CHECK(WIFEXITED(status));
  CHECK(!leader->sees(1));
  for (int fd : {ready[0], ready[1], go[0], go[1]}) ::close(fd);
}

TEST_CASE("shared-memory link: a forked child's copy neither closes nor unlinks its parent's side") {
  Host host(1);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    host.leader.reset();  // the destructors run in the child: they must leave the parent's segment alone
    host.member.clear();
    _exit(0);
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  CHECK(WIFEXITED(status));
  uint8_t byte = 42;
  host.member[0]->send(0, 0, 0x50, 1, &byte, 1, milliseconds(1000));
  byte = 0;
  CHECK(host.leader->receive(1, 1, 0x50, 1, &byte, 1, milliseconds(1000)) == 1);
  CHECK(byte == 42);
}

TEST_CASE("shared-memory link: a segment whose creator died before unlinking it is removed by the next creator") {
  int named[2];
  REQUIRE(::pipe(named) == 0);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    std::string why;
    auto link = ShmHostLink::create(1, 4096, why);
    char name[64] = {};
    if (link != nullptr) std::strncpy(name, link->name().c_str(), sizeof name - 1);
    if (::write(named[1], name, sizeof name) != static_cast<ssize_t>(sizeof name)) _exit(2);
    _exit(0);  // killed during setup, as it were: the name stays in /dev/shm
  }
  char name[64] = {};
  REQUIRE(::read(named[0], name, sizeof name) == static_cast<ssize_t>(sizeof name));
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  REQUIRE(name[0] == '/');
  const std::string path = std::string("/dev/shm") + name;
  CHECK(::access(path.c_str(), F_OK) == 0);
  // The same dead pid as named by a creator in another pid namespace (there it may be a live process), and by a
  // build before the namespace was in the name: neither can be judged from here, so both stay.
  unsigned long long pid = 0, start = 0, space = 0;
  REQUIRE(std::sscanf(name, "/psgd-%llu-%llu-%llx-", &pid, &start, &space) == 3);
  char other_space[32] = {};
  std::snprintf(other_space, sizeof other_space, "%llx", space ^ 1);
  const std::string elsewhere =
      "/psgd-" + std::to_string(pid) + "-" + std::to_string(start) + "-" + other_space + "-0123456789abcdef";
  const std::string older = "/psgd-" + std::to_string(pid) + "-" + std::to_string(start) + "-0123456789abcdef";
  for (const std::string& other : {elsewhere, older}) {
    const int fd = ::shm_open(other.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    REQUIRE(fd >= 0);
    ::close(fd);
  }
  std::string why;
  auto fresh = ShmHostLink::create(1, 4096, why);
  REQUIRE(fresh != nullptr);
  CHECK(::access(path.c_str(), F_OK) != 0);
  CHECK(::access((std::string("/dev/shm") + fresh->name()).c_str(), F_OK) == 0);
  CHECK(::access(("/dev/shm" + elsewhere).c_str(), F_OK) == 0);
  CHECK(::access(("/dev/shm" + older).c_str(), F_OK) == 0);
  ::shm_unlink(elsewhere.c_str());
  ::shm_unlink(older.c_str());
  CHECK(fresh->name().size() <= 60);  // sent to the members in 64 bytes
  ::close(named[0]);
  ::close(named[1]);
}

TEST_CASE("shared-memory link: a missing segment, another layout, a full /dev/shm: no link, the reason said") {
  std::string why;
  CHECK(ShmHostLink::open("/psgd-no-such-segment", 1, why) == nullptr);
  CHECK(why.find("shm_open") == 0);
  auto leader = ShmHostLink::create(1, 4096, why);
  REQUIRE(leader != nullptr);
  CHECK(ShmHostLink::open(leader->name(), 2, why) == nullptr);  // one member only
  CHECK(why.find("layout") != std::string::npos);
  auto member = ShmHostLink::open(leader->name(), 1, why);
  REQUIRE(member != nullptr);
  CHECK(!member->sees(0));  // the leader has not attached
  leader.reset();  // unlinks the name
  CHECK(ShmHostLink::open(member->name(), 1, why) == nullptr);

  // A /dev/shm too small for the segment, in a mount namespace of a child's own: creation fails there, where
  // tmpfs would otherwise have raised SIGBUS at the first touch of a page it cannot back.
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    if (::unshare(CLONE_NEWNS) != 0 || ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0 ||
        ::mount("tmpfs", "/dev/shm", "tmpfs", 0, "size=64k") != 0)
      _exit(77);
    std::string child_why;
    auto link = ShmHostLink::create(1, size_t{1} << 20, child_why);
    _exit(link == nullptr && child_why.find("posix_fallocate") == 0 ? 0 : 1);
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  REQUIRE(WIFEXITED(status));
  if (WEXITSTATUS(status) == 77)
    MESSAGE("skipped the full /dev/shm: no private mount namespace here (not root?)");
  else
    CHECK(WEXITSTATUS(status) == 0);
}

TEST_CASE("PSGD_HOST_SHM: auto by default, 0 off, anything else refused naming the value") {
  ::unsetenv("PSGD_HOST_SHM");
  CHECK(host_shm_from_env());
  ::setenv("PSGD_HOST_SHM", "auto", 1);
  CHECK(host_shm_from_env());
  ::setenv("PSGD_HOST_SHM", "0", 1);
  CHECK(!host_shm_from_env());
  ::setenv("PSGD_HOST_SHM", "1", 1);
  try {
    host_shm_from_env();
    FAIL("expected an InvalidArgumentError");
  } catch (const std::exception& e) {
    CHECK(std::string(e.what()).find("PSGD_HOST_SHM='1' is invalid") != std::string::npos);
  }
  ::unsetenv("PSGD_HOST_SHM");
}

int main(int argc, char** argv) { return powersgd::testing::run_selected_tests(argc, argv); }
