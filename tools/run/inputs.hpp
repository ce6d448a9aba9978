// Checks on what the launcher takes from its user and its environment before it
// hands it to ssh, a remote shell or the file system. Each check throws
// InvalidArgumentError (exit 2: bad command line) or IoError naming the value
// and what was expected. Kept apart from options.cpp so the rules have one home
// and a unit test and a fuzz target can reach them.
#pragma once

#include <chrono>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace powersgd::run {

// A host name as ssh receives it: a DNS name, an IPv4 address, an IPv6 address
// (bare, as parse_host_list leaves a bracketed one; '%' for a zone). The host is
// also looked up locally (getaddrinfo), so "user@host" is not one: --ssh-user.
// Refused: empty, a leading '-' (ssh would read it as an option, e.g.
// "-oProxyCommand=..."), whitespace, control characters, and any character
// outside [A-Za-z0-9._:%-] (shell and ssh metacharacters). `where` names the
// source, e.g. "--hosts entry 'x:2'" or "hostfile F line 3".
void validate_host_name(const std::string& name, const std::string& where);

// [A-Za-z_][A-Za-z0-9_]*: the names a POSIX shell can `export`.
bool is_shell_identifier(std::string_view name);

// The environment sent to ssh workers (ssh.hpp's wrapper exports each line).
// Throws InvalidArgumentError for a name that is not a shell identifier (the
// remote `export` would fail and kill the wrapper) or a value with a newline or
// NUL (it cannot be sent as one line).
void validate_forwarded_environment(const std::vector<std::pair<std::string, std::string>>& env);

// The longest --timeout / --grace: poll(2) takes an int of milliseconds.
inline constexpr std::chrono::milliseconds kMaxWait{2147483647};

// Milliseconds for poll(2) from a remaining duration: 0 when it is past,
// at most kMaxWait (the caller's loop polls again until its deadline).
int poll_timeout_ms(std::chrono::nanoseconds remaining);

// Creates or truncates a --log-dir file for writing, mode 0600, close-on-exec.
// Refuses (IoError naming the path) a symbolic link, a FIFO or device, a file
// with other hard links, or one owned by another user: the launcher may run as
// root in a directory others can write to. Returns the descriptor.
int open_log_file(const std::string& path);

}  // namespace powersgd::run
