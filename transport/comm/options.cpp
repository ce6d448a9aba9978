// CommOptions::from_env: membership from torchrun / MPI / Slurm variables,
// settings from the PSGD_* registry (docs/env.md).

#include <cerrno>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>

#include "common/check.hpp"
#include "common/env.hpp"
#include "comm/address.hpp"
#include "comm/launch_env.hpp"
#include "comm/options.hpp"
#include "common/log.hpp"
#include "powersgd/comm.hpp"

namespace powersgd {
namespace {

int parse_int(const env::Found& found, int min, int max, const char* expected) {
  const std::string& text = found.value;
  char* end = nullptr;
  errno = 0;
  long value = std::strtol(text.c_str(), &end, 10);
  PSGD_REQUIRE(errno == 0 && end != text.c_str() && *end == '\0', InvalidArgumentError, "environment variable ",
               found.name, "='", text, "' is not an integer (expected ", expected, ")");
  PSGD_REQUIRE(value >= min && value <= max, InvalidArgumentError, "environment variable ", found.name, "=", value,
               " is out of range: expected ", expected);
  return static_cast<int>(value);
}

}  // namespace

CommOptions CommOptions::single_process() {
  CommOptions o;
  o.rank = 0;
  o.world_size = 1;
  o.host_store = true;
  o.store_port = 0;
  o.address = "127.0.0.1";
  return o;
}

CommOptions CommOptions::from_env() {
  CommOptions o;
  auto world = env::first_of({"WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"});
  auto rank = env::first_of({"RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"});
  PSGD_REQUIRE(world.has_value(), InvalidArgumentError,
               "no world size in the environment: set WORLD_SIZE (or OMPI_COMM_WORLD_SIZE, PMI_SIZE, SLURM_NTASKS), "
               "or start the job with powersgd-run");
  PSGD_REQUIRE(rank.has_value(), InvalidArgumentError,
               "no rank in the environment: set RANK (or OMPI_COMM_WORLD_RANK, PMI_RANK, SLURM_PROCID), "
               "or start the job with powersgd-run");
  o.world_size = parse_int(*world, 1, std::numeric_limits<int>::max(), ">= 1");
  o.rank = parse_int(*rank, 0, o.world_size - 1,
                     detail::concat("0 to ", o.world_size - 1, " for ", world->name, "=", o.world_size).c_str());
  if (auto local = env::first_of({"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"}))
    o.local_rank = parse_int(*local, 0, std::numeric_limits<int>::max(), ">= 0");

  // Rendezvous store: MASTER_ADDR:MASTER_PORT, or derived from the launcher
  // that gave the rank (Slurm, Open MPI on one node; comm/launch_env.hpp).
  transport::Membership membership{rank->name, world->name, o.rank, o.world_size};
  transport::LaunchEnv launch = transport::LaunchEnv::from_environment();
  if (auto warning = transport::inherited_rank_warning(launch, membership)) PSGD_LOG(Warn, *warning);
  transport::Rendezvous rendezvous = transport::resolve_rendezvous(launch, membership);
  if (!rendezvous.addr.empty()) o.store_addr = rendezvous.addr;
  o.store_port = rendezvous.port;
  PSGD_LOG(Info, "rank ", o.rank, " of ", o.world_size, " from ", rank->name, " and ", world->name,
           rendezvous.launcher.empty() ? "" : " (" + rendezvous.launcher + ")", "; rendezvous ", rendezvous.origin);
  // torchrun convention: rank 0 hosts the store unless the launcher already does.
  auto hosted = env::get("PSGD_STORE_HOSTED");
  PSGD_REQUIRE(!hosted || *hosted == "0" || *hosted == "1", InvalidArgumentError, "environment variable ",
               "PSGD_STORE_HOSTED='", *hosted, "' is invalid: expected 0 or 1");
  o.host_store = o.rank == 0 && !(hosted && *hosted == "1");

  o.run_id = env::get_or_default("PSGD_RUN_ID");
  // A job whose derived port another job's store holds must not join that job's group.
  if (o.run_id.empty()) o.run_id = rendezvous.run_id;

  transport::apply_env_settings(o);
  if (o.transport == TransportKind::Tcp && o.iface.empty() && o.address.empty())
    o.address = transport::local_address_towards(o.store_addr, transport::kMasterAddr);
  return o;
}

}  // namespace powersgd

namespace powersgd::transport {

void apply_env_settings(CommOptions& o) {
  // On every path, the caller's store too (torch.distributed's): the job's keys carry the token's prefix.
  o.token = env::get_or_default("PSGD_TOKEN");
  std::string transport = env::get_or_default("PSGD_TRANSPORT");
  if (transport == "tcp")
    o.transport = TransportKind::Tcp;
  else if (transport == "ibverbs")
    o.transport = TransportKind::Ibverbs;
  else
    PSGD_THROW(InvalidArgumentError, "environment variable PSGD_TRANSPORT='", transport,
               "' is invalid: expected tcp or ibverbs");

  o.iface = env::get_or_default("PSGD_IFACE");
  o.address = env::get_or_default("PSGD_ADDR");
  PSGD_REQUIRE(o.iface.empty() || o.address.empty(), InvalidArgumentError, "PSGD_IFACE='", o.iface,
               "' and PSGD_ADDR='", o.address, "' are both set: expected at most one");

  o.ib_device = env::get_or_default("PSGD_IB_DEVICE");
  o.ib_port = static_cast<int>(env::get_int("PSGD_IB_PORT", 1, 255));
  o.ib_gid_index = static_cast<int>(env::get_int("PSGD_IB_GID_INDEX", 0, 255));
  o.timeout = std::chrono::milliseconds(env::get_int("PSGD_TIMEOUT_MS", 1, int64_t{24} * 3600 * 1000));
  o.ring_threshold_bytes =
      static_cast<size_t>(env::get_int("PSGD_RING_THRESHOLD_BYTES", 0, std::numeric_limits<int64_t>::max()));
}

bool eager_direct_from_env() {
  return env::get_switch("PSGD_DIRECT_EAGER", "receives posted one collective ahead, the default", "off");
}

bool scatter_gather_from_env() {
  return env::get_switch("PSGD_SCATTER_GATHER", "scatter-gather above the direct bound, the default", "bcube");
}

bool fingerprint_store_from_env() {
  return env::get_switch("PSGD_FINGERPRINT_STORE", "creation records through the store, the default", "Gloo's ring");
}

HostStageMode host_stage_from_env() {
  const std::string value = env::get_or_default("PSGD_HOST_STAGE");
  PSGD_REQUIRE(value == "0" || value == "1" || value == "auto", InvalidArgumentError,
               "environment variable PSGD_HOST_STAGE='", value,
               "' is invalid: expected 0 (off), 1 (host-staged allreduce) or auto (staged where ranks share a host)");
  return value == "0" ? HostStageMode::Off : value == "1" ? HostStageMode::On : HostStageMode::Auto;
}

const char* to_string(HostStageMode mode) {
  switch (mode) {
    case HostStageMode::Off:
      return "0";
    case HostStageMode::On:
      return "1";
    case HostStageMode::Auto:
      return "auto";
  }
  return "?";
}

size_t direct_max_bytes_from_env(bool scatter_gather) {
  const std::optional<std::string> value = env::get("PSGD_DIRECT_MAX_BYTES");
  if (!value) return scatter_gather ? kDirectAuto : kDirectFixedBytes;
  if (*value == "auto") return kDirectAuto;
  return static_cast<size_t>(env::get_int("PSGD_DIRECT_MAX_BYTES", 0, std::numeric_limits<int64_t>::max()));
}

}  // namespace powersgd::transport
