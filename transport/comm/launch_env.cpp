#include "comm/launch_env.hpp"

#include <unistd.h>

#include <cctype>
#include <charconv>
#include <climits>

#include "common/check.hpp"
#include "common/env.hpp"

namespace powersgd::transport {
namespace {

constexpr uint32_t kDerivedPortCount = kDerivedPortLast - kDerivedPortFirst + 1;
constexpr uint32_t kStepsPerJob = 32;

bool all_digits(std::string_view s) {
  if (s.empty()) return false;
  for (char c : s)
    if (!std::isdigit(static_cast<unsigned char>(c))) return false;
  return true;
}

std::optional<uint64_t> to_u64(std::string_view s) {
  uint64_t value = 0;
  if (!all_digits(s)) return std::nullopt;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
  if (ec != std::errc() || end != s.data() + s.size()) return std::nullopt;
  return value;
}

// One bracket's contents ("01-04,07") as the numbers it names, padded; stops
// past `limit` numbers (the caller reports the overflow).
std::vector<std::string> expand_ranges(std::string_view ranges, std::string_view list, std::string_view what,
                                       size_t limit) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (true) {
    size_t comma = ranges.find(',', pos);
    std::string_view range = ranges.substr(pos, comma == std::string_view::npos ? std::string_view::npos : comma - pos);
    size_t dash = range.find('-');
    std::string_view lo_text = range.substr(0, dash);
    std::string_view hi_text = dash == std::string_view::npos ? lo_text : range.substr(dash + 1);
    auto lo = to_u64(lo_text);
    auto hi = to_u64(hi_text);
    PSGD_REQUIRE(lo && hi && lo_text.size() <= 18 && hi_text.size() <= 18, InvalidArgumentError, what, "='", list,
                 "' is not a Slurm host list: range '", range, "' is not N or N-M (decimal numbers)");
    PSGD_REQUIRE(*lo <= *hi, InvalidArgumentError, what, "='", list, "' is not a Slurm host list: range '", range,
                 "' runs backwards");
    // Slurm pads to the width of the lower bound when it is written with a leading zero.
    size_t width = lo_text.size() > 1 && lo_text[0] == '0' ? lo_text.size() : 0;
    for (uint64_t n = *lo;; ++n) {
      std::string digits = std::to_string(n);
      if (digits.size() < width) digits.insert(0, width - digits.size(), '0');
      out.push_back(std::move(digits));
      if (n == *hi || out.size() > limit) break;
    }
    if (comma == std::string_view::npos) break;
    pos = comma + 1;
  }
  return out;
}

// One item of the list (no top-level comma): text and bracket groups.
void expand_item(std::string_view item, std::string_view list, std::string_view what, size_t max_hosts,
                 std::vector<std::string>& out) {
  PSGD_REQUIRE(!item.empty(), InvalidArgumentError, what, "='", list, "' is not a Slurm host list: an empty host name");
  std::vector<std::string> names{""};
  size_t pos = 0;
  while (pos < item.size()) {
    size_t open = item.find('[', pos);
    std::string_view text = item.substr(pos, open == std::string_view::npos ? std::string_view::npos : open - pos);
    PSGD_REQUIRE(text.find(']') == std::string_view::npos, InvalidArgumentError, what, "='", list,
                 "' is not a Slurm host list: ']' without '['");
    for (auto& name : names) name += text;
    if (open == std::string_view::npos) break;
    size_t close = item.find(']', open);
    PSGD_REQUIRE(close != std::string_view::npos, InvalidArgumentError, what, "='", list,
                 "' is not a Slurm host list: '[' without ']'");
    std::string_view inner = item.substr(open + 1, close - open - 1);
    PSGD_REQUIRE(inner.find('[') == std::string_view::npos, InvalidArgumentError, what, "='", list,
                 "' is not a Slurm host list: nested '['");
    std::vector<std::string> numbers = expand_ranges(inner, list, what, max_hosts);
    PSGD_REQUIRE(names.size() * numbers.size() + out.size() <= max_hosts, InvalidArgumentError, what, "='", list,
                 "' names more than ", max_hosts, " hosts");
    std::vector<std::string> next;
    next.reserve(names.size() * numbers.size());
    for (const auto& name : names)
      for (const auto& number : numbers) next.push_back(name + number);
    names = std::move(next);
    pos = close + 1;
  }
  PSGD_REQUIRE(names.size() + out.size() <= max_hosts, InvalidArgumentError, what, "='", list, "' names more than ",
               max_hosts, " hosts");
  for (auto& name : names) out.push_back(std::move(name));
}

uint64_t fnv1a(std::string_view text) {
  uint64_t hash = 0xcbf29ce484222325ULL;
  for (unsigned char c : text) {
    hash ^= c;
    hash *= 0x100000001b3ULL;
  }
  return hash;
}

// "name=value" for messages; "name unset" when absent.
std::string shown(std::string_view name, const std::optional<std::string>& value) {
  return value ? detail::concat(name, "=", *value) : detail::concat(name, " unset");
}

std::string short_name(const std::string& host) { return host.substr(0, host.find('.')); }

uint16_t parse_port(const std::string& text, std::string_view what) {
  auto value = to_u64(text);
  PSGD_REQUIRE(value && *value >= 1 && *value <= 65535, InvalidArgumentError, "environment variable ", what, "=",
               text, " is not a TCP port: expected 1 to 65535");
  return static_cast<uint16_t>(*value);
}

const char* const kExplicitFix = "export MASTER_ADDR=<rank 0's host> and MASTER_PORT=<a free port> to every rank";

// Slurm: the step's first host, its reserved port or one from the job and step ids.
void derive_from_slurm(const LaunchEnv& env, const Membership& m, Rendezvous& r, std::string& addr_origin,
                       std::string& port_origin) {
  PSGD_REQUIRE(env.slurm_job_id.has_value(), InvalidArgumentError,
               "Slurm task without SLURM_JOB_ID: cannot derive the rendezvous; ", kExplicitFix);
  std::string host;
  if (!env.master_addr) {
    const char* var = env.slurm_step_nodelist ? "SLURM_STEP_NODELIST" : "SLURM_JOB_NODELIST";
    const auto& list = env.slurm_step_nodelist ? env.slurm_step_nodelist : env.slurm_job_nodelist;
    PSGD_REQUIRE(list.has_value(), InvalidArgumentError,
                 "Slurm task without SLURM_STEP_NODELIST or SLURM_JOB_NODELIST: cannot tell rank 0's host; ",
                 kExplicitFix);
    host = expand_hostlist(*list, var).front();
    r.addr = host;
    addr_origin = detail::concat("first host of ", var, "=", *list);
    // Rank 0 hosts the store where the others look for it: under the default
    // task distributions rank 0 runs on the step's first node; a hostfile or
    // arbitrary distribution may place it elsewhere.
    if (m.rank == 0) {
      std::string here = env.slurmd_nodename ? *env.slurmd_nodename : env.hostname;
      bool same = here == host || short_name(here) == short_name(host);
      PSGD_REQUIRE(same, InvalidArgumentError, "Slurm: rank 0 runs on '", here, "' (",
                   env.slurmd_nodename ? "SLURMD_NODENAME" : "hostname", ") but the other ranks look for its store on '",
                   host, "', the first host of ", var, "=", *list,
                   " (a hostfile or arbitrary distribution placed rank 0 elsewhere): ", kExplicitFix);
    }
  }
  if (!env.master_port) {
    if (env.slurm_step_resv_ports) {
      // "12000", "12000-12003" or "12000,12005": the first port is the store's.
      const std::string& ports = *env.slurm_step_resv_ports;
      auto first = to_u64(std::string_view(ports).substr(0, ports.find_first_of("-,")));
      PSGD_REQUIRE(first && *first >= 1 && *first <= 65535, InvalidArgumentError,
                   "environment variable SLURM_STEP_RESV_PORTS=", ports,
                   " is not a list of TCP ports: expected a port (1 to 65535), a range N-M or a list N,M,... "
                   "whose first port is the store's");
      r.port = static_cast<uint16_t>(*first);
      port_origin = detail::concat("first of SLURM_STEP_RESV_PORTS=", ports);
    } else {
      // A world of one in the batch script (no step) with MASTER_ADDR alone: no step id to derive from.
      PSGD_REQUIRE(env.slurm_step_id.has_value(), InvalidArgumentError,
                   "Slurm: SLURM_STEP_ID unset (not a task of a job step, e.g. the batch script) and MASTER_PORT "
                   "unset: cannot derive the store's port; set MASTER_PORT to a free port, or unset MASTER_ADDR "
                   "(a world of one then uses a private store)");
      auto job = to_u64(*env.slurm_job_id);
      auto step = to_u64(*env.slurm_step_id);
      PSGD_REQUIRE(job && step, InvalidArgumentError, "Slurm: ", shown("SLURM_JOB_ID", env.slurm_job_id), " and ",
                   shown("SLURM_STEP_ID", env.slurm_step_id),
                   " are not both numbers: cannot derive the store's port; set MASTER_PORT to a free port");
      r.port = slurm_derived_port(*job, *step);
      port_origin = detail::concat("derived from SLURM_JOB_ID=", *job, " and SLURM_STEP_ID=", *step,
                                   " (srun --resv-ports=1 reserves one instead)");
    }
  }
  // Without a step (the batch script's world of one) the run is the job's batch step, as sacct names it.
  r.run_id = detail::concat("slurm-", *env.slurm_job_id, ".", env.slurm_step_id ? *env.slurm_step_id : "batch");
}

// Open MPI: only one node is known from the environment alone.
void derive_from_ompi(const LaunchEnv& env, Rendezvous& r, std::string& addr_origin, std::string& port_origin) {
  const auto& ns = env.ompi_jobid ? env.ompi_jobid : env.pmix_namespace;
  const char* ns_var = env.ompi_jobid ? "OMPI_MCA_ess_base_jobid" : "PMIX_NAMESPACE";
  if (!env.master_addr) {
    bool one_node = env.ompi_local_size && env.ompi_size && *env.ompi_local_size == *env.ompi_size;
    PSGD_REQUIRE(one_node, InvalidArgumentError, "Open MPI job over several nodes (",
                 shown("OMPI_COMM_WORLD_LOCAL_SIZE", env.ompi_local_size), ", ",
                 shown("OMPI_COMM_WORLD_SIZE", env.ompi_size),
                 "): its environment does not say where rank 0 runs, so the rendezvous store cannot be found. "
                 "Set MASTER_ADDR=<rank 0's host> and MASTER_PORT=<a free port> and pass both: "
                 "mpirun -x MASTER_ADDR -x MASTER_PORT ...; or start the job with powersgd-run --hosts");
    r.addr = "127.0.0.1";
    addr_origin = "loopback (one node: OMPI_COMM_WORLD_LOCAL_SIZE = OMPI_COMM_WORLD_SIZE)";
  }
  if (!env.master_port) {
    PSGD_REQUIRE(ns.has_value(), InvalidArgumentError,
                 "Open MPI job without OMPI_MCA_ess_base_jobid or PMIX_NAMESPACE: cannot derive the store's port; "
                 "set MASTER_PORT to a free port and pass it: mpirun -x MASTER_PORT ...");
    r.port = namespace_derived_port(*ns);
    port_origin = detail::concat("derived from ", ns_var, "=", *ns);
  }
  if (ns) r.run_id = detail::concat("ompi-", *ns);
}

}  // namespace

std::vector<std::string> expand_hostlist(std::string_view list, std::string_view what, size_t max_hosts) {
  PSGD_REQUIRE(!list.empty(), InvalidArgumentError, what, " is empty: expected a Slurm host list");
  std::vector<std::string> out;
  // Split at the commas outside brackets.
  size_t start = 0;
  int depth = 0;
  for (size_t i = 0; i <= list.size(); ++i) {
    if (i == list.size() || (list[i] == ',' && depth == 0)) {
      expand_item(list.substr(start, i - start), list, what, max_hosts, out);
      start = i + 1;
    } else if (list[i] == '[') {
      ++depth;
    } else if (list[i] == ']') {
      --depth;
    }
  }
  return out;
}

uint16_t slurm_derived_port(uint64_t job_id, uint64_t step_id) {
  constexpr uint32_t jobs = kDerivedPortCount / kStepsPerJob;
  return static_cast<uint16_t>(kDerivedPortFirst + (job_id % jobs) * kStepsPerJob + step_id % kStepsPerJob);
}

uint16_t namespace_derived_port(std::string_view job_namespace) {
  return static_cast<uint16_t>(kDerivedPortFirst + fnv1a(job_namespace) % kDerivedPortCount);
}

LaunchEnv LaunchEnv::from_environment() {
  LaunchEnv e;
  e.master_addr = env::get("MASTER_ADDR");
  e.master_port = env::get("MASTER_PORT");
  e.store_addr = env::get("PSGD_STORE_ADDR");
  e.store_port = env::get("PSGD_STORE_PORT");
  e.run_id = env::get("PSGD_RUN_ID");
  e.launcher_hosted = env::get("PSGD_STORE_HOSTED") == std::optional<std::string>("1");
  e.torchrun = env::get("TORCHELASTIC_RUN_ID").has_value();
  e.slurm_procid = env::get("SLURM_PROCID");
  e.slurm_ntasks = env::get("SLURM_NTASKS");
  e.slurm_step_nodelist = env::get("SLURM_STEP_NODELIST");
  e.slurm_job_nodelist = env::get("SLURM_JOB_NODELIST");
  e.slurm_step_resv_ports = env::get("SLURM_STEP_RESV_PORTS");
  e.slurm_job_id = env::get("SLURM_JOB_ID");
  e.slurm_step_id = env::get("SLURM_STEP_ID");
  e.slurmd_nodename = env::get("SLURMD_NODENAME");
  e.ompi_rank = env::get("OMPI_COMM_WORLD_RANK");
  e.ompi_size = env::get("OMPI_COMM_WORLD_SIZE");
  e.ompi_local_size = env::get("OMPI_COMM_WORLD_LOCAL_SIZE");
  e.ompi_jobid = env::get("OMPI_MCA_ess_base_jobid");
  e.pmix_namespace = env::get("PMIX_NAMESPACE");
  char name[HOST_NAME_MAX + 1] = {};
  if (gethostname(name, sizeof name - 1) == 0) e.hostname = name;
  return e;
}

Rendezvous resolve_rendezvous(const LaunchEnv& env, const Membership& m) {
  Rendezvous r;
  if (m.rank_var == "SLURM_PROCID")
    r.launcher = "Slurm";
  else if (m.rank_var == "OMPI_COMM_WORLD_RANK")
    r.launcher = "Open MPI";
  else if (m.rank_var == "PMI_RANK")
    r.launcher = "PMI";
  // powersgd-run gives its own store in PSGD_STORE_ADDR/PSGD_STORE_PORT and MASTER_ADDR/MASTER_PORT to
  // torch.distributed (whose rank 0 hosts a TCPStore there); a launcher that sets only MASTER_* still works.
  if (env.launcher_hosted && env.store_addr && env.store_port) {
    r.addr = *env.store_addr;
    r.port = parse_port(*env.store_port, "PSGD_STORE_PORT");
    r.origin = detail::concat(r.addr, ":", r.port, " (powersgd-run's store: PSGD_STORE_ADDR, PSGD_STORE_PORT)");
    return r;
  }
  std::string addr_origin = "MASTER_ADDR", port_origin = "MASTER_PORT";
  if (env.master_addr) r.addr = *env.master_addr;
  if (env.master_port) r.port = parse_port(*env.master_port, "MASTER_PORT");
  // The batch script's own environment has SLURM_PROCID=0 and SLURM_NTASKS but
  // no step: a program started there is alone, whatever MASTER_* say.
  PSGD_REQUIRE(r.launcher != "Slurm" || m.world_size == 1 || env.slurm_step_id.has_value(), InvalidArgumentError,
               "rank and world size come from Slurm (", m.rank_var, "=", m.rank, ", ", m.world_var, "=",
               m.world_size, ") but this process is not a task of a job step (SLURM_STEP_ID unset: e.g. the batch "
               "script itself, where no other task will join it): start it with srun (srun -n ", m.world_size,
               " prog)");
  // A single process may omit both and hosts a private store on a free loopback port.
  if (m.world_size == 1 && !env.master_addr && !env.master_port) {
    r.origin = "a private store on a free loopback port (a world of one)";
    return r;
  }
  if (!env.master_addr || !env.master_port) {
    if (r.launcher == "Slurm") {
      derive_from_slurm(env, m, r, addr_origin, port_origin);
    } else if (r.launcher == "Open MPI") {
      derive_from_ompi(env, r, addr_origin, port_origin);
    } else {
      const char* missing = !env.master_addr ? "MASTER_ADDR" : "MASTER_PORT";
      const char* expected = !env.master_addr ? "the address of the rendezvous store (rank 0's host)"
                                              : "the TCP port of the rendezvous store (1 to 65535)";
      if (r.launcher == "PMI")
        PSGD_THROW(InvalidArgumentError, missing, " is not set: expected ", expected, ". The rank comes from ",
                   m.rank_var, " (an MPI with PMI: MPICH, Intel MPI), whose environment does not say where rank 0 "
                   "runs: pass MASTER_ADDR and MASTER_PORT to every rank (mpiexec -genv MASTER_ADDR <host> -genv "
                   "MASTER_PORT <port>), or start the job with powersgd-run");
      // RANK/WORLD_SIZE given: the caller set the membership, so it sets the store too.
      std::string hint;
      if (env.slurm_procid && env.slurm_step_id)
        hint = detail::concat(". This process is a Slurm task (SLURM_PROCID=", *env.slurm_procid,
                              ") but its rank comes from ", m.rank_var,
                              ": unset RANK and WORLD_SIZE so that powersgd takes the membership and the "
                              "rendezvous from Slurm, or ",
                              kExplicitFix);
      else if (env.ompi_rank)
        hint = detail::concat(". This process was started by Open MPI (OMPI_COMM_WORLD_RANK=", *env.ompi_rank,
                              ") but its rank comes from ", m.rank_var,
                              ": unset RANK and WORLD_SIZE so that powersgd takes the membership and the "
                              "rendezvous from Open MPI, or ",
                              kExplicitFix);
      else
        hint = detail::concat(" (the rank comes from ", m.rank_var,
                              "): start the job with powersgd-run, torchrun, srun or mpirun, or ", kExplicitFix);
      PSGD_THROW(InvalidArgumentError, missing, " is not set: expected ", expected, hint);
    }
  }
  if (env.run_id) r.run_id.clear();
  r.origin = detail::concat(r.addr, ":", r.port, " (host: ", addr_origin, "; port: ", port_origin, ")");
  return r;
}

std::optional<std::string> inherited_rank_warning(const LaunchEnv& env, const Membership& m) {
  // powersgd-run and torchrun set RANK for processes they start themselves,
  // possibly inside a Slurm allocation or step (torchrun's ranks follow its own
  // rendezvous, not SLURM_PROCID): only a task that is itself the launcher's (a
  // step's task, an mpirun rank) and was started by neither can have
  // inherited a stale RANK.
  if (m.rank_var != "RANK" || env.launcher_hosted || env.torchrun) return std::nullopt;
  auto check = [&](const char* launcher, const char* rank_var, const std::optional<std::string>& rank,
                   const char* size_var, const std::optional<std::string>& size) -> std::optional<std::string> {
    if (!rank || !size || *size != std::to_string(m.world_size) || *rank == std::to_string(m.rank))
      return std::nullopt;
    return detail::concat("RANK=", m.rank, " differs from ", rank_var, "=", *rank, " while ", m.world_var, "=",
                          m.world_size, " and ", size_var, "=", *size,
                          " agree: RANK looks inherited (e.g. a batch script exported RANK before starting the ",
                          launcher, " tasks, so every task got the same value); unset RANK and WORLD_SIZE to take ",
                          "them from ", launcher);
  };
  if (env.slurm_step_id)
    if (auto w = check("Slurm", "SLURM_PROCID", env.slurm_procid, "SLURM_NTASKS", env.slurm_ntasks)) return w;
  return check("Open MPI", "OMPI_COMM_WORLD_RANK", env.ompi_rank, "OMPI_COMM_WORLD_SIZE", env.ompi_size);
}

}  // namespace powersgd::transport
