// Zero-configuration rendezvous: where the store is when the job was started by
// srun or mpirun and MASTER_ADDR / MASTER_PORT are not set (docs/launcher.md,
// "Slurm and MPI"). CommOptions::from_env reads the variables into a LaunchEnv
// once; everything else here is a pure function of their values, so the unit
// tests give it the forms Slurm and Open MPI emit. Private to powersgd.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace powersgd::transport {

// A Slurm host list as Slurm writes it ("node[01-04,07],gpu1", "r[1-2]n[1-3]"),
// expanded in Slurm's order: items left to right, several bracket groups in
// one name as nested loops (the last one fastest), each bracket's ranges in
// order, a bound written with leading zeros padding every number of its range
// to its width (checked against Slurm 22.05's `scontrol show hostnames`). Text
// after the last bracket ("gpu-a[1-2]x"), which that Slurm neither writes nor
// reads, is accepted too. Throws InvalidArgumentError naming `what` (the
// variable), the value and the fault when the list is malformed or would
// expand to more than `max_hosts` names.
std::vector<std::string> expand_hostlist(std::string_view list, std::string_view what,
                                         size_t max_hosts = size_t{1} << 20);

// Derived store ports lie in [kDerivedPortFirst, kDerivedPortLast]: below
// Linux's ephemeral range (32768-60999), so an outgoing connection never holds
// one by chance.
inline constexpr uint16_t kDerivedPortFirst = 20480;
inline constexpr uint16_t kDerivedPortLast = 32767;
// Slurm without reserved ports: 384 job slots of 32 steps, port =
// first + (job % 384) * 32 + step % 32. Steps of one job whose ids differ by
// less than 32, and jobs whose ids differ by less than 384, never share a port.
uint16_t slurm_derived_port(uint64_t job_id, uint64_t step_id);
// Open MPI: first + FNV-1a(namespace) % the range's size.
uint16_t namespace_derived_port(std::string_view job_namespace);

// The variables the derivation reads, as found (nullopt: unset or empty), and
// this host's name.
struct LaunchEnv {
  std::optional<std::string> master_addr, master_port;
  // powersgd-run's own store (PSGD_STORE_ADDR, PSGD_STORE_PORT): read before MASTER_* when launcher_hosted, as
  // MASTER_ADDR/MASTER_PORT are torch's there (docs/launcher.md).
  std::optional<std::string> store_addr, store_port;
  std::optional<std::string> run_id;                 // PSGD_RUN_ID
  bool launcher_hosted = false;                      // PSGD_STORE_HOSTED=1 (powersgd-run)
  bool torchrun = false;                             // TORCHELASTIC_RUN_ID set (a torchrun worker)
  // Slurm (a task of an srun step has SLURM_STEP_ID).
  std::optional<std::string> slurm_procid, slurm_ntasks, slurm_step_nodelist, slurm_job_nodelist,
      slurm_step_resv_ports, slurm_job_id, slurm_step_id, slurmd_nodename;
  // Open MPI.
  std::optional<std::string> ompi_rank, ompi_size, ompi_local_size, ompi_jobid, pmix_namespace;
  std::string hostname;                              // gethostname()

  // Reads every field from the environment (the registry, src/common/env.cpp).
  static LaunchEnv from_environment();
};

// Which variables gave this process its rank and world size (the names
// CommOptions::from_env took them from).
struct Membership {
  std::string rank_var, world_var;
  int rank = 0, world_size = 1;
};

// Where the store is and where that came from.
struct Rendezvous {
  std::string addr;      // empty with port 0: a single process hosting a private store
  uint16_t port = 0;
  std::string run_id;    // a default run id derived from the job, when PSGD_RUN_ID is unset
  std::string launcher;  // "Slurm", "Open MPI", "PMI", or "" (RANK/WORLD_SIZE: torchrun, powersgd-run, by hand)
  std::string origin;    // for the log: where the address and the port came from
};

// The rendezvous for this process: MASTER_ADDR and MASTER_PORT each win when
// set; otherwise they are derived from the launcher whose variables gave the
// rank (Slurm: first host of the step's node list, the step's reserved port or
// slurm_derived_port; Open MPI on one node: 127.0.0.1 and
// namespace_derived_port). Rank 0 under Slurm also checks that it runs on the
// host derived. Throws InvalidArgumentError naming the launcher detected, the
// variables and the fix when the rendezvous cannot be known.
Rendezvous resolve_rendezvous(const LaunchEnv& env, const Membership& membership);

// A warning when RANK looks inherited rather than set for this process: it
// differs from the rank the launcher gave this task (SLURM_PROCID in a Slurm
// step, OMPI_COMM_WORLD_RANK) while the world sizes agree, e.g. a batch script
// exported RANK=$SLURM_PROCID before srun and every task got RANK=0. nullopt
// when nothing looks wrong.
std::optional<std::string> inherited_rank_warning(const LaunchEnv& env, const Membership& membership);

}  // namespace powersgd::transport
