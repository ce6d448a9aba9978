// powersgd-run: the launcher. Usage and design: `powersgd-run --help`, docs/launcher.md.
#include <sched.h>
#include <signal.h>
#include <netinet/in.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <exception>
#include <memory>
#include <thread>

#include "comm/address.hpp"
#include "common/check.hpp"
#include "common/fd.hpp"
#include "guardian.hpp"
#include "netns.hpp"
#include "options.hpp"
#include "ssh.hpp"
#include "store/store.hpp"
#include "supervisor.hpp"

extern char** environ;

namespace powersgd::run {
namespace {

std::string random_hex(size_t bytes) {
  std::vector<unsigned char> data(bytes);
  size_t filled = 0;
  while (filled < bytes) {
    filled += static_cast<size_t>(PSGD_CHECK_SYS_RETRY(::getrandom(data.data() + filled, bytes - filled, 0)));
  }
  static const char digits[] = "0123456789abcdef";
  std::string hex;
  for (unsigned char c : data) {
    hex += digits[c >> 4];
    hex += digits[c & 15];
  }
  return hex;
}

// Every host problem found before the job starts is a bad command line (exit 2).
constexpr transport::HostRole kHost{"host"};
constexpr transport::HostRole kHostRoute{"host",
                                         "give the address workers should use to reach the launcher with --master-addr"};

bool all_loopback(const std::vector<Host>& hosts) {
  try {
    for (const auto& h : hosts)
      if (!transport::is_loopback(h.name, kHost)) return false;
    return true;
  } catch (const IoError& e) {
    throw InvalidArgumentError(e.what());
  }
}

std::string local_address_towards(const std::string& host) {
  try {
    return transport::local_address_towards(host, kHostRoute);
  } catch (const IoError& e) {
    throw InvalidArgumentError(e.what());
  }
}

// Creates the store with its listening socket inside the network namespace
// `netns_fd`: a socket belongs to the namespace of the thread that creates it,
// and setns() affects the calling thread only, so a short-lived thread does it.
std::unique_ptr<transport::TcpStoreServer> make_store_in_namespace(const transport::TcpStoreServerOptions& options,
                                                                   int netns_fd) {
  std::unique_ptr<transport::TcpStoreServer> server;
  std::exception_ptr error;
  std::thread([&] {
    try {
      PSGD_CHECK_SYS(::setns(netns_fd, CLONE_NEWNET));
      server = std::make_unique<transport::TcpStoreServer>(options);
    } catch (...) {
      error = std::current_exception();
    }
  }).join();
  if (error) std::rethrow_exception(error);
  return server;
}

using EnvList = std::vector<std::pair<std::string, std::string>>;

// A port for torch.distributed's TCPStore (MASTER_PORT: rank 0 binds it on every interface): one free here,
// below the kernel's ephemeral range, so that no outgoing connection takes it before rank 0 binds it; tried
// from a random start. A port the launcher's store and the engine never use (their ports are ephemeral).
uint16_t torch_store_port() {
  int ephemeral_low = 32768;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> ephemeral_low;
  const int first = 10000, count = std::max(1, ephemeral_low - first);
  uint32_t start = 0;
  if (::getrandom(&start, sizeof start, 0) != static_cast<ssize_t>(sizeof start)) start = static_cast<uint32_t>(::getpid());
  for (int i = 0; i < count; ++i) {
    const auto port = static_cast<uint16_t>(first + static_cast<int>((start + static_cast<uint32_t>(i)) % static_cast<uint32_t>(count)));
    Fd sock(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!sock) PSGD_THROW_ERRNO(IoError, errno, "socket for torch's store port");
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    if (::bind(sock.get(), reinterpret_cast<const sockaddr*>(&a), sizeof a) == 0) return port;
  }
  PSGD_THROW(IoError, "no free TCP port between ", first, " and ", ephemeral_low - 1, " for torch's store (MASTER_PORT)");
}

void set_var(EnvList& env, const std::string& name, const std::string& value) {
  for (auto& [n, v] : env)
    if (n == name) {
      v = value;
      return;
    }
  env.emplace_back(name, value);
}

std::vector<std::string> flatten(const EnvList& env) {
  std::vector<std::string> out;
  for (const auto& [n, v] : env) out.push_back(n + "=" + v);
  return out;
}

// A signal that came while the job was set up (the emulated cluster takes seconds for many hosts; the
// supervisor reads signals only once the workers run): the setup stops at its next step, what it made is
// removed on the way out, and the launcher exits 128 + signal before any worker starts.
struct SetupInterrupted {
  int signal;
};

void stop_on_signal(int signal_fd) {
  signalfd_siginfo info{};
  while (::read(signal_fd, &info, sizeof info) == static_cast<ssize_t>(sizeof info))
    if (info.ssi_signo != SIGCHLD) throw SetupInterrupted{static_cast<int>(info.ssi_signo)};
}

int run_job(const Options& options, int signal_fd) {
  Guardian guardian;  // first, while the launcher has one thread
  const GroupHooks watched = guardian.group_hooks();
  std::unique_ptr<EmulatedCluster> cluster;
  if (options.mode == Mode::Emulated) {
    cluster = std::make_unique<EmulatedCluster>(
        options.emulate_hosts, LinkOptions{options.link_rate_bits, options.link_delay, options.delay_mechanism},
        [&](const std::string& name) {
          stop_on_signal(signal_fd);
          guardian.watch_namespace(name);
        },
        GroupHooks{[&](pid_t pid) {
                     watched.spawned(pid);
                     stop_on_signal(signal_fd);
                   },
                   watched.reaped});
    stop_on_signal(signal_fd);
    if (!cluster->delay_method().empty())
      std::fprintf(stderr, "powersgd-run: --link-delay %s one way into each host: %s\n",
                   delay_text(options.link_delay).c_str(), cluster->delay_method().c_str());
  }

  transport::TcpStoreServerOptions store_options;
  store_options.token = random_hex(32);
  std::string master_addr;
  std::unique_ptr<transport::TcpStoreServer> store;
  switch (options.mode) {
    case Mode::Local:
      store_options.bind_address = master_addr = "127.0.0.1";
      store = std::make_unique<transport::TcpStoreServer>(store_options);
      break;
    case Mode::Ssh: {
      bool loopback = all_loopback(options.hosts);
      store_options.bind_address = loopback ? "127.0.0.1" : "0.0.0.0";
      master_addr = !options.master_addr.empty() ? options.master_addr
                    : loopback                   ? "127.0.0.1"
                                                 : local_address_towards(options.hosts.front().name);
      store = std::make_unique<transport::TcpStoreServer>(store_options);
      break;
    }
    case Mode::Emulated:
      store_options.bind_address = master_addr = EmulatedCluster::bridge_address();
      store = make_store_in_namespace(store_options, cluster->bridge_netns_fd());
      break;
  }

  // What every worker gets; the launcher's own settings win over --env, which wins over the inherited environment.
  EnvList job_env = options.env;
  const std::string run_id = random_hex(8);
  auto placements = place_ranks(options);
  char cwd[4096];
  if (::getcwd(cwd, sizeof cwd) == nullptr) PSGD_THROW_ERRNO(IoError, errno, "getcwd");

  SshOptions ssh = options.ssh;
  if (options.mode == Mode::Ssh) ssh.command[0] = resolve_program(ssh.command[0]);

  // torch.distributed's env:// rendezvous gets MASTER_ADDR/MASTER_PORT of its own (rank 0 hosts a TCPStore
  // there); the launcher's store, which the engine uses, is in PSGD_STORE_ADDR/PSGD_STORE_PORT.
  const int host0 = placements.front().host;
  const std::string torch_addr = options.mode == Mode::Local      ? "127.0.0.1"
                                 : options.mode == Mode::Emulated ? EmulatedCluster::host_address(host0)
                                                                  : options.hosts.at(static_cast<size_t>(host0)).name;
  // A fresh namespace has every port free; elsewhere one free here (for --hosts: on the launcher's machine only).
  const uint16_t torch_port = options.mode == Mode::Emulated ? 29500 : torch_store_port();

  std::vector<WorkerLaunch> launches;
  for (const auto& p : placements) {
    EnvList env;
    if (options.mode == Mode::Ssh) {
      for (char** e = environ; *e != nullptr; ++e) {
        std::string item(*e);
        if (item.rfind("PSGD_", 0) == 0 && item.find('=') != std::string::npos)
          env.emplace_back(item.substr(0, item.find('=')), item.substr(item.find('=') + 1));
      }
    } else {
      for (char** e = environ; *e != nullptr; ++e) {
        std::string item(*e);
        auto eq = item.find('=');
        if (eq != std::string::npos) env.emplace_back(item.substr(0, eq), item.substr(eq + 1));
      }
    }
    for (const auto& [n, v] : job_env) set_var(env, n, v);
    set_var(env, "RANK", std::to_string(p.rank));
    set_var(env, "WORLD_SIZE", std::to_string(placements.size()));
    set_var(env, "LOCAL_RANK", std::to_string(p.local_rank));
    set_var(env, "LOCAL_WORLD_SIZE", std::to_string(p.local_world_size));
    set_var(env, "MASTER_ADDR", torch_addr);
    set_var(env, "MASTER_PORT", std::to_string(torch_port));
    set_var(env, "PSGD_STORE_ADDR", master_addr);
    set_var(env, "PSGD_STORE_PORT", std::to_string(store->port()));
    set_var(env, "PSGD_TOKEN", store_options.token);
    set_var(env, "PSGD_STORE_HOSTED", "1");
    set_var(env, "PSGD_RUN_ID", run_id);

    WorkerLaunch launch;
    launch.rank = p.rank;
    switch (options.mode) {
      case Mode::Local:
        launch.where = "localhost";
        launch.spec.argv = options.command;
        launch.spec.env = flatten(env);
        break;
      case Mode::Emulated:
        // The transport must use the namespace's own address (PSGD_IFACE and PSGD_ADDR are exclusive).
        std::erase_if(env, [](const auto& item) { return item.first == "PSGD_IFACE"; });
        set_var(env, "PSGD_ADDR", EmulatedCluster::host_address(p.host));
        launch.where = cluster->names().at(static_cast<size_t>(p.host) + 1);
        launch.spec.argv = options.command;
        launch.spec.env = flatten(env);
        launch.spec.netns_fd = cluster->host_netns_fd(p.host);
        break;
      case Mode::Ssh: {
        const std::string& host = options.hosts.at(static_cast<size_t>(p.host)).name;
        launch.where = host;
        launch.spec.argv = ssh_command_line(ssh, host, options.command, cwd, options.grace);
        for (char** e = environ; *e != nullptr; ++e) launch.spec.env.emplace_back(*e);
        launch.spec.stdin_pipe = true;
        launch.stdin_data = environment_block(env);
        break;
      }
    }
    launches.push_back(std::move(launch));
  }

  int code = 0;
  {
    Supervisor supervisor({options.grace, options.timeout, options.log_dir, 10}, signal_fd);
    supervisor.group_hooks = watched;
    if (cluster) supervisor.check_helpers = [&] { return cluster->check_delayers(); };
    supervisor.start(std::move(launches));
    code = supervisor.run();
  }
  store->stop();
  if (cluster) cluster->remove();
  guardian.release();
  return code;
}

}  // namespace
}  // namespace powersgd::run

int main(int argc, char** argv) {
  using namespace powersgd;
  auto parsed = run::parse_command_line(argc, argv);
  if (!parsed.options) return parsed.exit_code;
  const run::Options& options = *parsed.options;

  if (options.mode == run::Mode::Emulated) {
    std::string problem = run::emulation_privilege_problem();
    if (!problem.empty()) {
      std::fprintf(stderr, "powersgd-run: error: %s\n", problem.c_str());
      return 2;
    }
  }

  // Each worker's stdout and stderr pipes (and stdin over ssh), its rank's connection to the store and, with
  // --log-dir, its two log files; each emulated host's namespace and delayer (3); a margin for the rest: refused
  // here, before anything starts, where the limit cannot hold them.
  try {
    const uint64_t files = run::raise_descriptor_limit();
    const uint64_t per_worker = 3 + (options.mode == run::Mode::Ssh ? 1 : 0) + (options.log_dir.empty() ? 0 : 2);
    const uint64_t needed = per_worker * static_cast<uint64_t>(options.nproc) +
                            3 * static_cast<uint64_t>(options.emulate_hosts) + 64;
    if (needed > files) {
      const std::string hosts =
          options.emulate_hosts > 0 ? detail::concat(" on ", options.emulate_hosts, " emulated hosts") : "";
      std::fprintf(stderr, "%s\n",
                   detail::concat("powersgd-run: error: -n ", options.nproc, hosts, " needs about ", needed,
                                  " descriptors in the launcher (the workers' pipes, their ranks' store connections",
                                  hosts.empty() ? "" : ", the hosts' delayers", "), more than its limit of ", files,
                                  " (RLIMIT_NOFILE's hard limit): raise it (ulimit -Hn, LimitNOFILE=) or start "
                                  "fewer workers per launcher")
                       .c_str());
      return 2;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "powersgd-run: error: %s\n", e.what());
    return 1;
  }

  // Signals are taken through a signalfd by the supervisor's poll loop; block
  // them before any thread exists so that no thread receives them instead.
  sigset_t set;
  sigemptyset(&set);
  for (int sig : {SIGCHLD, SIGINT, SIGTERM, SIGHUP}) sigaddset(&set, sig);
  try {
    PSGD_CHECK_SYS(::sigprocmask(SIG_BLOCK, &set, nullptr));
    ::signal(SIGPIPE, SIG_IGN);  // a closed stdout must not kill the launcher (and its cleanup)
    Fd signal_fd(PSGD_CHECK_SYS(::signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK)));
    return run::run_job(options, signal_fd.get());
  } catch (const run::SetupInterrupted& interrupted) {
    std::fprintf(stderr, "powersgd-run: got SIG%s while setting up the job; stopped before any worker started\n",
                 sigabbrev_np(interrupted.signal));
    return 128 + interrupted.signal;
  } catch (const InvalidArgumentError& e) {
    std::fprintf(stderr, "powersgd-run: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "powersgd-run: error: %s\n", e.what());
    return 1;
  }
}
