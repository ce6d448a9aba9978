// Remote workers over ssh. The launcher starts one local ssh process per remote
// worker; the remote side runs a POSIX sh wrapper (ssh.cpp) that
//  1. reads the worker's environment as "K=V" lines from stdin up to an empty
//     line (so the job token never appears on a command line),
//  2. starts the worker in its own session (setsid when available),
//  3. keeps reading stdin, which the launcher never closes while the worker
//     runs: EOF means the ssh connection or the launcher is gone, and the
//     wrapper then sends the worker SIGTERM, and SIGKILL after the grace period,
//  4. exits with the worker's exit code (128+signal when it was killed), which
//     ssh passes back to the launcher.
// No pty is used (ssh -T), so stdout and stderr stay apart.
#pragma once

#include <chrono>
#include <string>
#include <utility>
#include <vector>

#include "options.hpp"

namespace powersgd::run {

// The local ssh command line for one worker on `host`.
std::vector<std::string> ssh_command_line(const SshOptions& ssh, const std::string& host,
                                          const std::vector<std::string>& command, const std::string& cwd,
                                          std::chrono::milliseconds grace);

// What the launcher writes first to the ssh process's stdin. Throws
// InvalidArgumentError for a name that is not a shell identifier or a value with
// a newline (validate_forwarded_environment in inputs.hpp).
std::string environment_block(const std::vector<std::pair<std::string, std::string>>& env);

// 'text' quoted for a POSIX shell.
std::string shell_quote(const std::string& text);

}  // namespace powersgd::run
