// File descriptors: the one owning handle and the one write loop of the tree.
#pragma once

#include <cstddef>

namespace powersgd {

// An owned file descriptor (-1: none); closes on destruction. Move-only.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(other.release()) {}
  Fd& operator=(Fd&& other) noexcept;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }

  int get() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }
  // Gives up ownership: the caller closes the descriptor.
  int release();
  // Closes the descriptor, ignoring errors (for error paths and destruction).
  void reset();
  // Closes the descriptor and reports a failure as IoError (data written to a
  // file may only fail to reach it here, e.g. on NFS). Idempotent.
  void close();

 private:
  int fd_ = -1;
};

// write() until all of `data` is written, retrying interrupted (EINTR) and
// short writes. Returns 0, or the errno of the write that failed (EPIPE for a
// closed pipe; EIO for a write that wrote nothing). Never throws, so callers
// choose: the launcher drops output to a closed stdout, a checkpoint throws.
int write_all(int fd, const void* data, size_t size) noexcept;

// Closes every descriptor >= first, or with cloexec_only marks them
// close-on-exec instead. Uses close_range(2) where the kernel has it (Linux
// 5.9; 5.11 for close-on-exec), else each descriptor listed in /proc/self/fd,
// else every descriptor below the RLIMIT_NOFILE limit. Async-signal-safe (no
// allocation), for a child between fork and exec. Returns 0, or the errno of the
// last way that failed.
int close_descriptors_from(int first, bool cloexec_only) noexcept;

// The /proc/self/fd way alone; exposed so tests reach it on kernels that have close_range.
int close_listed_descriptors_from(int first, bool cloexec_only) noexcept;

// Number of descriptors this process has open now (listed in /proc/self/fd; 0
// where it cannot be read). For budgets against RLIMIT_NOFILE.
size_t open_descriptor_count() noexcept;

}  // namespace powersgd
