#include "comm/shm_link.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <random>
#include <sstream>

#include "common/check.hpp"
#include "common/env.hpp"

namespace powersgd::transport {

bool host_shm_from_env() {
  const std::string value = env::get_or_default("PSGD_HOST_SHM");
  PSGD_REQUIRE(value == "auto" || value == "0", InvalidArgumentError,
               "environment variable PSGD_HOST_SHM='", value,
               "' is invalid: expected auto (the hops within a host through shared memory where it works) or 0 "
               "(over TCP)");
  return value != "0";
}

namespace {

constexpr uint64_t kMagic = 0x70736764'73686d31ull;  // "psgdshm1"
constexpr uint32_t kVersion = 1;
constexpr uint32_t kAbsent = 0, kAttached = 1, kClosed = 2;
// How often a wait looks at /proc for the peer's process: an exited peer fails the waiter within this.
constexpr auto kLivenessPeriod = std::chrono::milliseconds(10);
constexpr size_t kPage = 4096;

struct Header {
  uint64_t magic;
  uint32_t version;
  uint32_t members;
  uint64_t ring_bytes;
  uint64_t bytes;  // the segment's size
};

}  // namespace

struct alignas(64) ShmHostLink::Participant {
  std::atomic<uint32_t> state;  // kAbsent, kAttached, kClosed
  int32_t pid;
  uint64_t start_time;  // field 22 of /proc/<pid>/stat: with the pid, this process and no later one
  uint64_t pid_namespace;  // pid_namespace(): a pid means this process only within the same namespace
};

// One direction between two participants. head and tail count bytes ever written and read; `written` and
// `taken` change after each and are the futex words the reader and the writer sleep on.
struct ShmHostLink::RingControl {
  alignas(64) std::atomic<uint64_t> head;
  std::atomic<uint32_t> written;
  alignas(64) std::atomic<uint64_t> tail;
  std::atomic<uint32_t> taken;
};

namespace {

static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<uint32_t>::is_always_lock_free,
              "shared-memory rings need lock-free atomics (address-free across processes)");
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "futex words are 32-bit");

// Every offset in the segment follows from the member count and the ring size alone.
struct Layout {
  size_t participants, controls, data, bytes;
  Layout(size_t members, size_t ring_bytes) {
    participants = sizeof(Header) <= 64 ? 64 : kPage;
    controls = participants + (members + 1) * sizeof(ShmHostLink::Participant);
    data = (controls + 2 * members * sizeof(ShmHostLink::RingControl) + kPage - 1) / kPage * kPage;
    bytes = data + 2 * members * ring_bytes;
  }
};

enum class Process { Running, Gone, Unknown };

// Whether process `pid` runs (not a zombie), and its start time: Gone where /proc has no such process or it
// is a zombie, Unknown where /proc cannot be read now (a descriptor limit, say): a wait then looks again later.
Process process_state(pid_t pid, uint64_t& start) {
  const std::string path = "/proc/" + std::to_string(pid) + "/stat";
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno == ENOENT || errno == ESRCH ? Process::Gone : Process::Unknown;
  char text[1024];
  const ssize_t got = ::read(fd, text, sizeof text - 1);
  const int read_error = errno;
  ::close(fd);
  if (got <= 0) return got == 0 || read_error == ESRCH ? Process::Gone : Process::Unknown;
  text[got] = '\0';
  const char* close = std::strrchr(text, ')');
  if (close == nullptr) return Process::Unknown;
  std::istringstream fields(close + 1);
  std::string state, field;
  fields >> state;  // field 3
  for (int k = 4; k < 22 && fields >> field; ++k) {
  }
  if (!(fields >> start)) return Process::Unknown;
  return state == "Z" || state == "X" || state == "x" ? Process::Gone : Process::Running;
}

// This process's pid namespace (device and inode of /proc/self/ns/pid; 0 where unreadable): pids compare only
// within one.
uint64_t pid_namespace() {
  struct stat st {};
  if (::stat("/proc/self/ns/pid", &st) != 0) return 0;
  return (static_cast<uint64_t>(st.st_dev) << 32) ^ static_cast<uint64_t>(st.st_ino);
}

void futex_wait(std::atomic<uint32_t>& word, uint32_t seen, std::chrono::nanoseconds period) {
  timespec ts{};
  ts.tv_sec = static_cast<time_t>(period.count() / 1'000'000'000);
  ts.tv_nsec = static_cast<long>(period.count() % 1'000'000'000);
  // Not FUTEX_PRIVATE: the word is shared between processes. EAGAIN (changed), EINTR, ETIMEDOUT: look again.
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT, seen, &ts, nullptr, 0);
}

void futex_wake(std::atomic<uint32_t>& word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

constexpr const char* kNamePrefix = "psgd-";

// "/psgd-<pid>-<start time>-<pid namespace, hex>-<16 hex digits>": the creator's process in the name, so that a
// later creator can tell a segment whose creator died before unlinking it (killed during setup) from a live one;
// and its pid namespace, since a pid names that process only there (a creator in another one, sharing /dev/shm,
// would otherwise judge a live segment by an unrelated pid and remove it). At most 60 characters: the leader
// sends it to its members in 64 bytes (host_stage.cpp).
constexpr char kHex[] = "0123456789abcdef";

std::string segment_name(pid_t pid, uint64_t start, uint64_t space) {
  std::random_device device;
  std::string name = detail::concat("/", kNamePrefix, pid, "-", start, "-", std::hex, space, "-");
  for (int k = 0; k < 2; ++k) {  // 64 random bits: with O_EXCL and the pid, enough to be unguessable and unique
    const uint32_t word = device();
    for (int nibble = 0; nibble < 8; ++nibble) name += kHex[(word >> (4 * nibble)) & 15];
  }
  return name;
}

// Unlinks this user's segments in /dev/shm whose creator is gone (the name's pid no longer runs with the
// name's start time), of creators in pid namespace `here` (this process's) only. Best effort: what cannot be
// read or removed stays (a name without a namespace too: a build before it, whose pid this cannot judge).
void remove_stale_segments(uint64_t here) {
  DIR* dir = ::opendir("/dev/shm");
  if (dir == nullptr) return;
  const uid_t me = ::geteuid();
  while (const dirent* entry = ::readdir(dir)) {
    const std::string name = entry->d_name;
    if (name.rfind(kNamePrefix, 0) != 0) continue;
    unsigned long long pid = 0, start = 0, space = 0;
    char rest[32] = {};
    if (std::sscanf(name.c_str() + std::strlen(kNamePrefix), "%llu-%llu-%llx-%16s", &pid, &start, &space, rest) != 4 ||
        space != here || here == 0)
      continue;
    struct stat st {};
    if (::fstatat(::dirfd(dir), entry->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 || st.st_uid != me) continue;
    uint64_t running_start = 0;
    const Process state = process_state(static_cast<pid_t>(pid), running_start);
    if (state == Process::Gone || (state == Process::Running && running_start != start))
      ::shm_unlink(("/" + name).c_str());
  }
  ::closedir(dir);
}

std::string errno_text(const char* call, int error) { return detail::concat(call, ": ", detail::errno_text(error)); }

// A message's frame: the slot in the mark's low byte, the tag, the length.
struct Frame {
  uint32_t mark;
  uint32_t tag;
  uint64_t bytes;
};
constexpr uint32_t mark_of(uint8_t slot) { return 0x50534700u | slot; }

std::string hex_byte(uint32_t value) {
  return {kHex[(value >> 4) & 15], kHex[value & 15]};
}

Header& header_of(void* base) { return *static_cast<Header*>(base); }

}  // namespace

ShmHostLink::ShmHostLink(std::string name, void* base, size_t bytes, size_t participant)
    : name_(std::move(name)), base_(base), bytes_(bytes), participant_(participant), owner_(::getpid()) {
  const Header& header = header_of(base);
  const Layout layout(header.members, header.ring_bytes);
  auto* const at = static_cast<uint8_t*>(base);
  members_ = header.members;
  ring_bytes_ = header.ring_bytes;
  participants_ = reinterpret_cast<Participant*>(at + layout.participants);
  controls_ = reinterpret_cast<RingControl*>(at + layout.controls);
  rings_ = at + layout.data;
}

ShmHostLink::~ShmHostLink() {
  // A child forked after creation inherits the mapping: it only unmaps, leaving its parent's side as it is.
  if (::getpid() == owner_) {
    close();
    if (participant_ == 0) unlink();
  }
  ::munmap(base_, bytes_);
}

std::unique_ptr<ShmHostLink> ShmHostLink::create(size_t members, size_t ring_bytes, std::string& why) {
  PSGD_ASSERT(members >= 1 && ring_bytes >= kPage && (ring_bytes & (ring_bytes - 1)) == 0,
              "shared-memory link of ", members, " members, ", ring_bytes, " bytes per ring");
  const Layout layout(members, ring_bytes);
  const uint64_t space = pid_namespace();
  remove_stale_segments(space);
  uint64_t start = 0;
  if (process_state(::getpid(), start) != Process::Running) {
    why = "/proc/self/stat cannot be read (the waits could not tell when a peer exits)";
    return nullptr;
  }
  std::string name;
  try {
    name = segment_name(::getpid(), start, space);
  } catch (const std::exception& e) {  // std::random_device without a source: TCP hops, as for any setup failure
    why = detail::concat("no random source for the segment's name (", e.what(), ")");
    return nullptr;
  }
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) {
    why = errno_text("shm_open", errno);
    return nullptr;
  }
  // Reserved now: tmpfs allocates on first touch, and a touch it cannot back is a SIGBUS.
  if (const int error = ::posix_fallocate(fd, 0, static_cast<off_t>(layout.bytes)); error != 0) {
    why = detail::concat(errno_text("posix_fallocate", error), " (", layout.bytes, " bytes in /dev/shm)");
    ::close(fd);
    ::shm_unlink(name.c_str());
    return nullptr;
  }
  void* base = ::mmap(nullptr, layout.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int map_error = errno;
  ::close(fd);
  if (base == MAP_FAILED) {
    why = errno_text("mmap", map_error);
    ::shm_unlink(name.c_str());
    return nullptr;
  }
  // The segment is zero-filled: every participant absent, every ring empty.
  Header& header = header_of(base);
  header.version = kVersion;
  header.members = static_cast<uint32_t>(members);
  header.ring_bytes = ring_bytes;
  header.bytes = layout.bytes;
  header.magic = kMagic;
  return std::unique_ptr<ShmHostLink>(new ShmHostLink(name, base, layout.bytes, 0));
}

std::unique_ptr<ShmHostLink> ShmHostLink::open(const std::string& name, size_t participant, std::string& why) {
  const int fd = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) {
    why = errno_text("shm_open", errno);
    return nullptr;
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < kPage) {
    why = detail::concat("the segment is ", st.st_size, " bytes");
    ::close(fd);
    return nullptr;
  }
  const auto bytes = static_cast<size_t>(st.st_size);
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int map_error = errno;
  ::close(fd);
  if (base == MAP_FAILED) {
    why = errno_text("mmap", map_error);
    return nullptr;
  }
  const Header& header = header_of(base);
  const bool valid = header.magic == kMagic && header.version == kVersion && header.members >= participant &&
                     participant >= 1 && header.ring_bytes >= kPage &&
                     (header.ring_bytes & (header.ring_bytes - 1)) == 0 && header.bytes == bytes &&
                     Layout(header.members, header.ring_bytes).bytes == bytes;
  if (!valid) {
    why = detail::concat("the segment's layout is not this version's for participant ", participant);
    ::munmap(base, bytes);
    return nullptr;
  }
  return std::unique_ptr<ShmHostLink>(new ShmHostLink(name, base, bytes, participant));
}

void ShmHostLink::attach() {
  Participant& me = participants_[participant_];
  me.pid = static_cast<int32_t>(::getpid());
  uint64_t start = 0;
  me.start_time = process_state(::getpid(), start) == Process::Running ? start : 0;
  me.pid_namespace = pid_namespace();
  me.state.store(kAttached, std::memory_order_release);
}

bool ShmHostLink::sees(size_t participant) const {
  Participant& peer = participants_[participant];
  if (peer.state.load(std::memory_order_acquire) != kAttached || peer.start_time == 0 ||
      peer.pid_namespace != pid_namespace())
    return false;
  uint64_t start = 0;
  return process_state(peer.pid, start) == Process::Running && start == peer.start_time;
}

void ShmHostLink::unlink() {
  if (unlinked_) return;
  unlinked_ = true;
  ::shm_unlink(name_.c_str());
}

void ShmHostLink::close() {
  if (::getpid() != owner_) return;  // a forked child: not its side to close
  Participant& me = participants_[participant_];
  if (me.state.exchange(kClosed, std::memory_order_acq_rel) == kClosed) return;
  for (size_t m = 0; m < members_; ++m) {
    if (participant_ != 0 && m + 1 != participant_) continue;
    for (size_t ring : {2 * m, 2 * m + 1}) {
      RingControl& control = controls_[ring];
      control.written.fetch_add(1, std::memory_order_release);
      control.taken.fetch_add(1, std::memory_order_release);
      futex_wake(control.written);
      futex_wake(control.taken);
    }
  }
}

size_t ShmHostLink::ring_index(size_t peer_participant, bool outgoing) const {
  // Ring 2m carries member m's messages to the leader, ring 2m + 1 the leader's to member m.
  const size_t member = participant_ == 0 ? peer_participant - 1 : participant_ - 1;
  const bool upward = participant_ == 0 ? !outgoing : outgoing;
  return 2 * member + (upward ? 0 : 1);
}

namespace {

// Sleeps on `word` until `ready()`; throws where the peer closed its side or exited, or at the deadline. What
// the peer wrote before it closed or exited is read first: ready() is asked again after seeing either (the
// acquire load that saw the state also sees every write made before it).
template <class Ready>
void wait_until(std::atomic<uint32_t>& word, const Ready& ready, const ShmHostLink::Participant& other,
                int peer_rank, std::chrono::steady_clock::time_point deadline, const char* waiting_for) {
  auto next_look = std::chrono::steady_clock::now() + kLivenessPeriod;
  for (;;) {
    const uint32_t seen = word.load(std::memory_order_acquire);
    if (ready()) return;
    if (other.state.load(std::memory_order_acquire) == kClosed) {
      if (ready()) return;
      throw HostHopError(peer_rank, false,
                         detail::concat("rank ", peer_rank, " closed its side of the host's shared memory while this "
                                        "rank waited for ", waiting_for, " (its group broke)"));
    }
    const auto now = std::chrono::steady_clock::now();
    if (now >= next_look) {
      uint64_t start = 0;
      const Process state = process_state(other.pid, start);
      if (state == Process::Gone || (state == Process::Running && start != other.start_time)) {
        if (ready()) return;
        throw HostHopError(peer_rank, false,
                           detail::concat("rank ", peer_rank, " (pid ", other.pid, ") exited while this rank waited "
                                          "for ", waiting_for, " through the host's shared memory"));
      }
      next_look = now + kLivenessPeriod;
    }
    if (now >= deadline)
      throw HostHopError(peer_rank, true,
                         detail::concat("Timed out waiting for rank ", peer_rank, " (", waiting_for,
                                        " through the host's shared memory)"));
    futex_wait(word, seen, std::min<std::chrono::nanoseconds>(next_look - now, deadline - now));
  }
}

// Moves a ring's head (or tail) to `value` after the bytes it covers were copied, and wakes the other side.
void publish(std::atomic<uint64_t>& position, uint64_t value, std::atomic<uint32_t>& word) {
  position.store(value, std::memory_order_release);
  word.fetch_add(1, std::memory_order_release);
  futex_wake(word);
}

}  // namespace

void ShmHostLink::write(size_t ring, size_t peer, int peer_rank, const void* data, size_t bytes, Deadline deadline) {
  const size_t capacity = ring_bytes_;
  RingControl& control = controls_[ring];
  uint8_t* const buffer = rings_ + ring * ring_bytes_;
  const auto* from = static_cast<const uint8_t*>(data);
  uint64_t head = control.head.load(std::memory_order_relaxed);  // written by this side only
  while (bytes > 0) {
    const auto used = static_cast<size_t>(head - control.tail.load(std::memory_order_acquire));
    if (used > capacity)  // a tail past the head: as the reader's check, never a copy past the ring
      throw HostHopError(peer_rank, false,
                         detail::concat("the ring to rank ", peer_rank, " holds ", used, " bytes, more than its ",
                                        capacity, ": the host's shared memory was overwritten"));
    const size_t space = capacity - used;
    if (space == 0) {
      wait_until(
          control.taken,
          [&] { return head - control.tail.load(std::memory_order_acquire) < capacity; }, participants_[peer],
          peer_rank, deadline, "room to send");
      continue;
    }
    const size_t n = std::min(space, bytes), at = static_cast<size_t>(head & (capacity - 1));
    const size_t first = std::min(n, capacity - at);
    std::memcpy(buffer + at, from, first);
    std::memcpy(buffer, from + first, n - first);
    head += n;
    from += n;
    bytes -= n;
    publish(control.head, head, control.written);
  }
}

void ShmHostLink::read(size_t ring, size_t peer, int peer_rank, void* data, size_t bytes, Deadline deadline) {
  const size_t capacity = ring_bytes_;
  RingControl& control = controls_[ring];
  const uint8_t* const buffer = rings_ + ring * ring_bytes_;
  auto* to = static_cast<uint8_t*>(data);
  uint64_t tail = control.tail.load(std::memory_order_relaxed);  // written by this side only
  while (bytes > 0) {
    const size_t ready = static_cast<size_t>(control.head.load(std::memory_order_acquire) - tail);
    if (ready > capacity)
      throw HostHopError(peer_rank, false,
                         detail::concat("the ring from rank ", peer_rank, " holds ", ready, " bytes, more than its ",
                                        capacity, ": the host's shared memory was overwritten"));
    if (ready == 0) {
      wait_until(
          control.written, [&] { return control.head.load(std::memory_order_acquire) != tail; },
          participants_[peer], peer_rank, deadline, "a message");
      continue;
    }
    const size_t n = std::min(ready, bytes), at = static_cast<size_t>(tail & (capacity - 1));
    const size_t first = std::min(n, capacity - at);
    std::memcpy(to, buffer + at, first);
    std::memcpy(to + first, buffer, n - first);
    tail += n;
    to += n;
    bytes -= n;
    publish(control.tail, tail, control.taken);
  }
}

void ShmHostLink::send(size_t peer_participant, int peer_rank, uint8_t slot, uint32_t tag, const void* data,
                       size_t bytes, std::chrono::milliseconds timeout) {
  const Deadline deadline = std::chrono::steady_clock::now() + timeout;
  const size_t ring = ring_index(peer_participant, true);
  const Frame frame{mark_of(slot), tag, bytes};
  write(ring, peer_participant, peer_rank, &frame, sizeof frame, deadline);
  write(ring, peer_participant, peer_rank, data, bytes, deadline);
}

size_t ShmHostLink::receive(size_t peer_participant, int peer_rank, uint8_t slot, uint32_t tag, void* data,
                            size_t capacity, std::chrono::milliseconds timeout) {
  const Deadline deadline = std::chrono::steady_clock::now() + timeout;
  const size_t ring = ring_index(peer_participant, false);
  Frame frame{};
  read(ring, peer_participant, peer_rank, &frame, sizeof frame, deadline);
  if (frame.mark != mark_of(slot) || frame.tag != tag)
    throw HostHopError(peer_rank, false,
                       detail::concat("rank ", peer_rank, " is out of step: it sent a message of slot 0x",
                                      hex_byte(frame.mark & 0xff), " (operation ", frame.tag,
                                      ") where this rank expected slot 0x", hex_byte(slot), " (operation ", tag,
                                      ")"));
  if (frame.bytes > capacity)
    throw HostHopError(peer_rank, false,
                       detail::concat("rank ", peer_rank, " sent ", frame.bytes, " bytes where this rank expected at most ",
                                      capacity, " (slot 0x", hex_byte(slot), ")"));
  read(ring, peer_participant, peer_rank, data, static_cast<size_t>(frame.bytes), deadline);
  return static_cast<size_t>(frame.bytes);
}

}  // namespace powersgd::transport
