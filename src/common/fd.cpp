#include "fd.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <linux/close_range.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <utility>

#include "check.hpp"

namespace powersgd {

Fd& Fd::operator=(Fd&& other) noexcept {
  if (this != &other) {
    reset();
    fd_ = other.release();
  }
  return *this;
}

int Fd::release() { return std::exchange(fd_, -1); }

void Fd::reset() {
  // No retry on EINTR: Linux closes the descriptor even then.
  if (fd_ >= 0) (void)::close(fd_);
  fd_ = -1;
}

void Fd::close() {
  if (fd_ >= 0) PSGD_CHECK_SYS(::close(release()));
}

int write_all(int fd, const void* data, size_t size) noexcept {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t n = ::write(fd, p, size);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno;
    if (n == 0) return EIO;
    p += n;
    size -= static_cast<size_t>(n);
  }
  return 0;
}

namespace {

// Closes, or marks close-on-exec, one descriptor. EBADF (already closed) is fine.
int release_descriptor(int fd, bool cloexec_only) noexcept {
  int rc = cloexec_only ? ::fcntl(fd, F_SETFD, FD_CLOEXEC) : ::close(fd);
  return rc == 0 || errno == EBADF || (!cloexec_only && errno == EINTR) ? 0 : errno;
}

}  // namespace

int close_listed_descriptors_from(int first, bool cloexec_only) noexcept {
  int dir = ::open("/proc/self/fd", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir < 0) return errno;
  // Closing entries while reading the directory may skip some (as glibc's
  // closefrom fallback knows): read again from the start until a pass closes none.
  int err = 0;
  for (bool again = true; again && err == 0;) {
    again = false;
    if (::lseek(dir, 0, SEEK_SET) != 0) {
      err = errno;
      break;
    }
    alignas(dirent64) char buffer[4096];
    for (;;) {
      long n = ::syscall(SYS_getdents64, dir, buffer, sizeof(buffer));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) err = errno;
      if (n <= 0) break;
      for (long offset = 0; offset < n;) {
        const auto* entry = reinterpret_cast<const dirent64*>(buffer + offset);
        offset += entry->d_reclen;
        int fd = 0;
        const char* c = entry->d_name;
        if (*c == '\0' || *c == '.') continue;
        for (; *c >= '0' && *c <= '9'; ++c) fd = fd * 10 + (*c - '0');
        if (fd < first || fd == dir) continue;
        if (int failed = release_descriptor(fd, cloexec_only); failed != 0) err = failed;
        again = !cloexec_only;
      }
    }
  }
  ::close(dir);
  return err;
}

int close_descriptors_from(int first, bool cloexec_only) noexcept {
  if (::syscall(SYS_close_range, static_cast<unsigned>(first), ~0U, cloexec_only ? CLOSE_RANGE_CLOEXEC : 0U) == 0)
    return 0;
  // ENOSYS before Linux 5.9, EINVAL for CLOSE_RANGE_CLOEXEC before 5.11.
  int err = close_listed_descriptors_from(first, cloexec_only);
  if (err == 0) return 0;
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) return errno;
  // A bounded last resort: /proc is missing (a chroot, an early boot).
  const rlim_t end = limit.rlim_cur == RLIM_INFINITY ? rlim_t{1} << 20 : std::min<rlim_t>(limit.rlim_cur, 1 << 20);
  err = 0;
  for (rlim_t fd = static_cast<rlim_t>(first); fd < end; ++fd)
    if (int failed = release_descriptor(static_cast<int>(fd), cloexec_only); failed != 0) err = failed;
  return err;
}

size_t open_descriptor_count() noexcept {
  size_t n = 0;
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return 0;
  while (const dirent* entry = ::readdir(dir))
    if (entry->d_name[0] != '.') ++n;
  ::closedir(dir);
  return n > 0 ? n - 1 : 0;  // less the directory's own descriptor
}

}  // namespace powersgd
