#include "env.hpp"

#include <charconv>
#include <cstdlib>

#include "check.hpp"

namespace powersgd::env {
namespace {

// Keep in the order of the documentation table.
constexpr Variable kVariables[] = {
    // Process group membership (torchrun's names, then MPI and Slurm fallbacks).
    {"RANK", "", "This process's rank in [0, WORLD_SIZE)."},
    {"WORLD_SIZE", "", "Number of processes in the job."},
    {"LOCAL_RANK", "", "Rank among the processes on this host."},
    {"LOCAL_WORLD_SIZE", "", "Number of processes on this host: set by powersgd-run for the program (torchrun's "
                             "convention), not read by the library."},
    {"MASTER_ADDR", "", "Address of the rendezvous store (rank 0 hosts it when the launcher does not). Unset "
                        "under srun or a one-node mpirun: derived (docs/launcher.md, Slurm and MPI). Under "
                        "powersgd-run: torch.distributed's (rank 0's host), not read by powersgd."},
    {"MASTER_PORT", "", "TCP port of the rendezvous store. Unset under srun or mpirun: derived (docs/launcher.md). "
                        "Under powersgd-run: a free port for torch.distributed's TCPStore, not read by powersgd."},
    {"OMPI_COMM_WORLD_RANK", "", "Open MPI's rank, used when RANK is unset."},
    {"OMPI_COMM_WORLD_SIZE", "", "Open MPI's world size, used when WORLD_SIZE is unset."},
    {"OMPI_COMM_WORLD_LOCAL_RANK", "", "Open MPI's local rank, used when LOCAL_RANK is unset."},
    {"OMPI_COMM_WORLD_LOCAL_SIZE", "", "Open MPI's ranks on this node; equal to OMPI_COMM_WORLD_SIZE (one node): "
                                       "the store is on 127.0.0.1 when MASTER_ADDR is unset."},
    {"OMPI_MCA_ess_base_jobid", "", "Open MPI's job id: the store's port (20480-32767) when MASTER_PORT is unset."},
    {"PMIX_NAMESPACE", "", "PMIx job namespace: the store's port when MASTER_PORT and OMPI_MCA_ess_base_jobid are "
                           "unset."},
    {"PMI_RANK", "", "PMI (MPICH, Intel MPI) rank, used when RANK is unset."},
    {"PMI_SIZE", "", "PMI world size, used when WORLD_SIZE is unset."},
    {"SLURM_PROCID", "", "Slurm rank, used when RANK is unset."},
    {"SLURM_NTASKS", "", "Slurm world size, used when WORLD_SIZE is unset."},
    {"SLURM_LOCALID", "", "Slurm local rank, used when LOCAL_RANK is unset."},
    {"SLURM_STEP_NODELIST", "", "Slurm step's hosts: the first is rank 0's, the store's host when MASTER_ADDR is "
                                "unset."},
    {"SLURM_JOB_NODELIST", "", "Slurm job's hosts, used when SLURM_STEP_NODELIST is unset."},
    {"SLURM_STEP_RESV_PORTS", "", "Ports Slurm reserved for the step (srun --resv-ports): the first is the "
                                  "store's when MASTER_PORT is unset."},
    {"SLURM_JOB_ID", "", "Slurm job id: with SLURM_STEP_ID, the store's port (20480-32767) when MASTER_PORT and "
                         "SLURM_STEP_RESV_PORTS are unset, and the default run id."},
    {"SLURM_STEP_ID", "", "Slurm step id (set in tasks of srun steps only): see SLURM_JOB_ID."},
    {"SLURMD_NODENAME", "", "Slurm node this task runs on: rank 0 checks it is the first host of the node list."},
    {"TORCHELASTIC_RUN_ID", "", "Set by torchrun: its RANK is its own, never warned about as inherited from a "
                                "batch script."},
    // Library settings.
    {"PSGD_TOKEN", "", "Job token (shared secret) the store requires of every client; on a caller's store "
                       "(torch.distributed's) the job's keys carry a prefix derived from it. Empty: no "
                       "authentication."},
    {"PSGD_STORE_HOSTED", "", "Set to 1 by powersgd-run: the store runs in the launcher, rank 0 must not host one."},
    {"PSGD_STORE_ADDR", "", "Set by powersgd-run: the address of its store, the rendezvous when "
                           "PSGD_STORE_HOSTED=1 (MASTER_ADDR is torch.distributed's there)."},
    {"PSGD_STORE_PORT", "", "Port of powersgd's store: set by powersgd-run (its store, the rendezvous when "
                           "PSGD_STORE_HOSTED=1, beside torch's MASTER_PORT); beside torch.distributed for the C "
                           "API's psgd_comm_init_beside_torch / psgd_comm_init_group, default MASTER_PORT+1 (MASTER_PORT "
                           "itself with PSGD_STORE_HOSTED=1). "
                           "powersgd.torch does not use it: its communicators rendezvous through torch's own store "
                           "(psgd_comm_init_on_store)."},
    {"PSGD_RUN_ID", "", "Key prefix in the rendezvous store; set it when several jobs share one store (e.g. a file store)."},
    {"PSGD_TRANSPORT", "tcp", "Data transport: tcp or ibverbs."},
    {"PSGD_IFACE", "", "Network interface for the TCP transport (e.g. eth0). Exclusive with PSGD_ADDR."},
    {"PSGD_ADDR", "", "Local address or hostname for the TCP transport. Default on multi-host jobs: the "
                      "address this host uses to reach MASTER_ADDR."},
    {"PSGD_TIMEOUT_MS", "300000", "Timeout of rendezvous and of every collective, in milliseconds."},
    {"PSGD_RING_THRESHOLD_BYTES", "8388608",
     "Allreduce messages of at least this many bytes use the ring algorithm; smaller ones direct or scatter-gather (tcp, "
     "see PSGD_DIRECT_MAX_BYTES) or halving-doubling (ibverbs). Must be equal on every rank. Measured crossover: "
     "docs/transport.md."},
    {"PSGD_DIRECT_MAX_BYTES", "auto",
     "Allreduce messages below the ring threshold whose copies from all other ranks add up to at most this "
     "many bytes ((world size - 1) * message bytes) use the direct algorithm, one round (tcp; 0: never). "
     "auto: chosen at creation from the measured latency between the ranks (256 KiB below 1 ms per one-round "
     "exchange, 1 MiB below 4 ms, else 4 MiB) and, above 1 ms among more than two ranks or staged hosts with scatter-gather, from the measured rate (lower where direct's "
     "bytes would cost more than scatter-gather's extra round): the same bits at any bound, as direct and "
     "scatter-gather add in the same order. Unset with PSGD_SCATTER_GATHER=0: 262144 (bcube's sums differ from direct's, so the "
     "bound would change the bits). Must be equal on every rank. Measured: docs/scaling.md."},
    {"PSGD_DIRECT_EAGER", "1",
     "1: the direct allreduce posts its receives one direct collective ahead (and scatter-gather those of "
     "its first exchange), so that a peer's data leaves "
     "without waiting for Gloo's ready-to-receive notice: one one-way delay per collective instead of two "
     "(messages up to min(1 MiB, PSGD_DIRECT_MAX_BYTES / (world size - 1)) per peer; among host-staged leaders, hosts - 1). 0: off. The sums are the "
     "same bits either way. Must be equal on every rank. docs/transport.md, \"Eager direct allreduce\"."},
    {"PSGD_SCATTER_GATHER", "1",
     "1: allreduce messages between the direct bound and the ring threshold use the scatter-gather algorithm "
     "(tcp): two rounds on any number of ranks, rank r adds everyone's r-th chunk in rank order and sends the "
     "sum to all, the same bits as direct. 0: Gloo's bcube there (2 log2(world size) rounds), as before it. "
     "Must be equal on every rank. docs/transport.md, \"Scatter-gather allreduce\"."},
    {"PSGD_FINGERPRINT_STORE", "1",
     "1: at creation this rank publishes its settings record in the store and, where every rank does, reads "
     "every rank's from it (two store round trips after the mesh: the set and one read) instead of Gloo's ring "
     "allgather (2 (world size - 1) one-way delays). 0: the ring, as builds before it (A/B benchmarks). May "
     "differ between ranks: any 0, and every rank takes the ring. docs/transport.md, step 5 of the rendezvous."},
    {"PSGD_HOST_STAGE", "auto",
     "1: host-staged allreduce (tcp): the ranks that share a host send their buffers to its lowest rank, which "
     "adds them in rank order; only these leaders allreduce across hosts (direct, scatter-gather or ring chosen for the "
     "number of hosts), then send the result back, so the rounds count hosts, not ranks; the lead exchange (the "
     "order guard's announce carrying P) is staged alike. The hops within a host "
     "go through shared memory where it works, else over TCP (PSGD_HOST_SHM). No effect with one host or one rank per "
     "host. auto (the default): as 1 where some host has two ranks or more, the API can stage (tcp, Gloo's new "
     "API) and every host's leader has the file descriptors for the leaders' context; else off. 0: off (every "
     "allreduce among all ranks, summed in rank order whatever the placement). Must be equal on every rank. "
     "docs/transport.md, \"Host-staged allreduce\"."},
    {"PSGD_HOST_SHM", "auto",
     "With host staging in effect: auto (the default) sends the hops within a host through a shared-memory "
     "segment of its leader's (/dev/shm, 1 MiB each way per other rank of the host) where every rank of the host "
     "can map it and it and its leader see each other's process, else over TCP (logged at info level); 0: over "
     "TCP. May differ "
     "between ranks and hosts: the bits are the same either way. docs/transport.md, \"Host-staged allreduce\"."},
    {"PSGD_HOST_ID", "",
     "With PSGD_HOST_STAGE=1 or auto: the name of this rank's host; ranks with the same name are staged together "
     "(compared whole). Default: the hostname and the transport's local address (hosts emulated by network "
     "namespaces share a hostname). Set it where hosts share names, or to split ranks of one host for tests."},
    {"PSGD_FUSE_REDUCTIONS", "1",
     "1: a Reducer's worker proposes the reductions queued behind the running one to run fused with it (one "
     "announce, P and Q for all: docs/engine.md, \"Fusing queued reductions\"). 0: this rank proposes nothing, so "
     "every rank reduces one by one (A/B benchmarks). Read when a Reducer is made; may differ between ranks; the "
     "bits are the same either way."},
    {"PSGD_CARRY_FIRST", "1",
     "1: a Reducer's order-guard announce carries the reduction's first collective where it can (docs/engine.md, "
     "\"The announce carries P\"): a round fewer. 0: this rank's announces carry nothing, so no rank's first "
     "collective is summed in them (A/B benchmarks). Read when a Reducer is made; may differ between ranks; the "
     "bits are the same either way."},
    {"PSGD_IB_DEVICE", "", "ibverbs device name (empty: the first device)."},
    {"PSGD_IB_PORT", "1", "ibverbs port number."},
    {"PSGD_IB_GID_INDEX", "0", "ibverbs GID index."},
    {"PSGD_CUDA_MODULE", "",
     "Path of the CUDA backend module (libpowersgd-cuda.so) to load for Device::Cuda; only this path is tried. "
     "Default: beside libpowersgd.so, then the dynamic loader's search path."},
    {"PSGD_BLAS_THREADS", "", "OpenBLAS thread count for the CPU backend (default: OpenBLAS's own); its fused "
                              "kernels use as many threads on large matrices."},
    {"PSGD_CPU_KERNELS", "", "CPU backend's fused-kernel variant: avx512, avx2 or sse2 (default: the widest this "
                             "CPU runs); another name, or one the CPU lacks, is an UnsupportedError naming those it runs. Results "
                             "are the same bits with each."},
    {"PSGD_LOG_LEVEL", "warn", "Library log level: error, warn, info or debug (another value: one warning naming "
                               "it, then warn; logging cannot refuse it)."},
};

}  // namespace

std::span<const Variable> variables() { return kVariables; }

static const Variable& lookup(std::string_view name) {
  for (const auto& v : kVariables)
    if (v.name == name) return v;
  PSGD_ASSERT(false, "environment variable ", name, " is not registered in src/common/env.cpp");
  __builtin_unreachable();
}

std::optional<std::string> get(std::string_view name) {
  const Variable& v = lookup(name);
  const char* value = std::getenv(std::string(v.name).c_str());
  if (value == nullptr || *value == '\0') return std::nullopt;
  return std::string(value);
}

std::string get_or_default(std::string_view name) {
  if (auto value = get(name)) return *value;
  return std::string(lookup(name).default_value);
}

int64_t get_int(std::string_view name, int64_t min, int64_t max) {
  std::string text = get_or_default(name);
  int64_t value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  PSGD_REQUIRE(ec == std::errc() && end == text.data() + text.size(), InvalidArgumentError, "environment variable ",
               name, "='", text, "' is not an integer");
  PSGD_REQUIRE(value >= min && value <= max, InvalidArgumentError, "environment variable ", name, "=", value,
               " is out of range: expected ", min, " to ", max);
  return value;
}

bool get_switch(std::string_view name, std::string_view on, std::string_view off) {
  const std::string value = get_or_default(name);
  PSGD_REQUIRE(value == "0" || value == "1", InvalidArgumentError, "environment variable ", name, "='", value,
               "' is invalid: expected 1 (", on, ") or 0 (", off, ")");
  return value == "1";
}

std::optional<Found> first_of(std::initializer_list<std::string_view> names) {
  for (auto name : names)
    if (auto value = get(name)) return Found{std::string(name), *value};
  return std::nullopt;
}

}  // namespace powersgd::env
