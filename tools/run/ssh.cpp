#include "ssh.hpp"

#include <cmath>

#include "common/check.hpp"
#include "inputs.hpp"

namespace powersgd::run {
namespace {

// The remote wrapper (see ssh.hpp). Non-interactive sh gives background jobs
// /dev/null as stdin, so the watcher gets the connection's stdin through fd 3.
// @GRACE@ is replaced by the grace period in whole seconds (rounded up).
constexpr const char* kWrapper = R"(while IFS= read -r l && [ -n "$l" ]; do export "$l"; done
exec 3<&0 </dev/null
s=; command -v setsid >/dev/null 2>&1 && s=setsid
$s "$@" 3<&- & w=$!
{ while read -r _; do :; done; kill -TERM -$w 2>/dev/null || kill -TERM $w 2>/dev/null; i=0; while [ $i -lt @GRACE@ ] && kill -0 $w 2>/dev/null; do sleep 1; i=$((i+1)); done; kill -KILL -$w 2>/dev/null || kill -KILL $w 2>/dev/null; } <&3 &
r=$!
exec 3<&-
wait $w; c=$?
kill $r 2>/dev/null
exit $c)";

}  // namespace

std::string shell_quote(const std::string& text) {
  std::string out = "'";
  for (char c : text) {
    if (c == '\'') out += "'\\''";
    else out += c;
  }
  return out + "'";
}

std::vector<std::string> ssh_command_line(const SshOptions& ssh, const std::string& host,
                                          const std::vector<std::string>& command, const std::string& cwd,
                                          std::chrono::milliseconds grace) {
  std::vector<std::string> argv = ssh.command;
  argv.push_back("-T");  // no pty: keeps stderr apart and the remote exit code intact
  // ssh keeps the first value given for an option, so the user's come first.
  for (const auto& option : ssh.options) {
    argv.push_back("-o");
    argv.push_back(option);
  }
  argv.insert(argv.end(), {"-o", "BatchMode=yes"});  // never prompt: there is no one to answer
  if (ssh.port != 0) argv.insert(argv.end(), {"-p", std::to_string(ssh.port)});
  if (!ssh.user.empty()) argv.insert(argv.end(), {"-l", ssh.user});
  argv.push_back("--");  // the host is never an option, whatever it starts with
  argv.push_back(host);

  std::string wrapper = kWrapper;
  auto seconds = static_cast<long>(std::ceil(static_cast<double>(grace.count()) / 1000.0));
  wrapper.replace(wrapper.find("@GRACE@"), 7, std::to_string(seconds));
  std::string remote = "cd " + shell_quote(cwd) + " 2>/dev/null; exec sh -c " + shell_quote(wrapper) +
                       " powersgd-worker";
  for (const auto& word : command) remote += " " + shell_quote(word);
  argv.push_back(remote);
  return argv;
}

std::string environment_block(const std::vector<std::pair<std::string, std::string>>& env) {
  validate_forwarded_environment(env);
  std::string block;
  for (const auto& [name, value] : env) block += name + "=" + value + "\n";
  return block + "\n";
}

}  // namespace powersgd::run
