#include "inputs.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>

#include "common/check.hpp"

namespace powersgd::run {
namespace {

bool host_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '-' ||
         c == '_' || c == ':' || c == '%';
}

// The value as it may be printed: control characters escaped, so an error
// message cannot itself carry terminal escapes or line breaks.
std::string printable(const std::string& text) {
  std::string out;
  for (unsigned char c : text) {
    if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      static const char digits[] = "0123456789abcdef";
      out += "\\x";
      out += digits[c >> 4];
      out += digits[c & 15];
    }
  }
  return out;
}

}  // namespace

void validate_host_name(const std::string& name, const std::string& where) {
  const std::string shown = printable(name);
  PSGD_REQUIRE(!name.empty(), InvalidArgumentError, where, ": the host name is empty");
  PSGD_REQUIRE(name.front() != '-', InvalidArgumentError, where, ": host name '", shown,
               "' starts with '-' (ssh would read it as an option): expected a host name or address");
  auto bad = std::find_if_not(name.begin(), name.end(), host_char);
  PSGD_REQUIRE(bad == name.end(), InvalidArgumentError, where, ": host name '", shown, "' has the character '",
               printable(std::string(1, *bad)),
               "': expected a DNS name or an IPv4 or IPv6 address (a user name goes in --ssh-user)");
}

bool is_shell_identifier(std::string_view name) {
  auto letter = [](char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; };
  return !name.empty() && letter(name.front()) &&
         std::all_of(name.begin() + 1, name.end(), [&](char c) { return letter(c) || (c >= '0' && c <= '9'); });
}

void validate_forwarded_environment(const std::vector<std::pair<std::string, std::string>>& env) {
  for (const auto& [name, value] : env) {
    PSGD_REQUIRE(is_shell_identifier(name), InvalidArgumentError, "environment variable '", printable(name),
                 "' cannot be passed to ssh workers: its name is not a shell identifier ([A-Za-z_][A-Za-z0-9_]*); "
                 "unset or rename it");
    PSGD_REQUIRE(value.find('\n') == std::string::npos && value.find('\0') == std::string::npos,
                 InvalidArgumentError, "environment variable ", name,
                 " has a newline in its value, which cannot be sent to ssh workers");
  }
}

int poll_timeout_ms(std::chrono::nanoseconds remaining) {
  if (remaining <= std::chrono::nanoseconds::zero()) return 0;
  const auto ms = std::chrono::ceil<std::chrono::milliseconds>(remaining);
  return static_cast<int>(std::min(ms, kMaxWait).count());
}

int open_log_file(const std::string& path) {
  // No O_TRUNC before the checks: a file that is refused is left as it was.
  // O_NONBLOCK: opening a FIFO must not wait for a reader (it is refused below).
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK | O_NOCTTY, 0600);
  PSGD_REQUIRE(fd >= 0, IoError, "cannot create log file ", path, ": ", detail::errno_text(errno),
               errno == ELOOP   ? " (it is a symbolic link, which is not followed)"
               : errno == ENXIO ? " (a FIFO or socket: not a regular file)"
                                : "");
  auto refuse = [&](const char* why) {
    ::close(fd);
    throw IoError(detail::concat("refusing log file ", path, ": ", why));
  };
  struct stat st {};
  if (::fstat(fd, &st) != 0) refuse(detail::errno_text(errno).c_str());
  if (!S_ISREG(st.st_mode)) refuse("not a regular file");
  if (st.st_nlink != 1) refuse("it has other hard links");
  if (st.st_uid != ::geteuid()) refuse("owned by another user");
  if (::ftruncate(fd, 0) != 0 || ::fchmod(fd, 0600) != 0 || ::fcntl(fd, F_SETFL, 0) != 0)
    refuse(detail::errno_text(errno).c_str());
  return fd;
}

}  // namespace powersgd::run
