// transport/comm/launch_env: Slurm host lists in the forms Slurm writes, the
// derived ports, and the rendezvous (and its errors) from canned Slurm, Open MPI
// and torchrun-style environments. Pure: nothing is read from the process's
// environment and nothing is sent.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include "support/doctest_main.hpp"

#include <set>

#include "comm/launch_env.hpp"
#include "powersgd/error.hpp"

using namespace powersgd;
using namespace powersgd::transport;

namespace {

using Hosts = std::vector<std::string>;

Hosts expand(std::string_view list) { return expand_hostlist(list, "SLURM_STEP_NODELIST"); }

// The message of the InvalidArgumentError `f` throws ("" when it throws none).
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const InvalidArgumentError& e) {
    return e.what();
  }
  return "";
}

bool has(const std::string& text, std::string_view needle) { return text.find(needle) != std::string::npos; }

// A task of `srun -n 4` step 3 of job 1234 on nodes node[01-02], as Slurm sets it.
LaunchEnv slurm_task(int procid) {
  LaunchEnv e;
  e.slurm_procid = std::to_string(procid);
  e.slurm_ntasks = "4";
  e.slurm_job_id = "1234";
  e.slurm_step_id = "3";
  e.slurm_job_nodelist = "node[01-02]";
  e.slurm_step_nodelist = "node[01-02]";
  e.slurmd_nodename = procid < 2 ? "node01" : "node02";
  e.hostname = procid < 2 ? "node01.cluster.example" : "node02.cluster.example";
  return e;
}

Membership slurm_membership(int rank) { return {"SLURM_PROCID", "SLURM_NTASKS", rank, 4}; }

// A rank of `mpirun -n 4` on one node (Open MPI 4.1's variables).
LaunchEnv ompi_rank(int rank, const char* local_size = "4") {
  LaunchEnv e;
  e.ompi_rank = std::to_string(rank);
  e.ompi_size = "4";
  e.ompi_local_size = local_size;
  e.ompi_jobid = "3472359425";
  e.pmix_namespace = "3472359425";
  e.hostname = "vm";
  return e;
}

Membership ompi_membership(int rank) { return {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", rank, 4}; }

}  // namespace

TEST_CASE("hostlist: the forms Slurm writes") {
  CHECK(expand("localhost") == Hosts{"localhost"});
  CHECK(expand("node1,node2") == Hosts{"node1", "node2"});
  CHECK(expand("node[1-3]") == Hosts{"node1", "node2", "node3"});
  // Zero padding to the lower bound's width, across a change in digit count.
  CHECK(expand("node[08-11]") == Hosts{"node08", "node09", "node10", "node11"});
  CHECK(expand("n[098-101]") == Hosts{"n098", "n099", "n100", "n101"});
  CHECK(expand("n[8-10]") == Hosts{"n8", "n9", "n10"});
  // Commas inside brackets (ranges and single numbers) and outside (items); a suffix
  // after a bracket (Slurm 22.05 writes "gpu-a1x,gpu-a2x" instead, but accepting it costs nothing).
  CHECK(expand("node[01-04,07],gpu-a[1-2]x") ==
        Hosts{"node01", "node02", "node03", "node04", "node07", "gpu-a1x", "gpu-a2x"});
  CHECK(expand("c[1,3,5]") == Hosts{"c1", "c3", "c5"});
  // Several brackets in one name: nested loops, the last fastest.
  CHECK(expand("rack[1-2]-n[01-02]") == Hosts{"rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"});
  // Prefix with digits and dashes, single-number bracket, a suffix, a domain.
  CHECK(expand("gpu-7a[3]b.cluster") == Hosts{"gpu-7a3b.cluster"});
  CHECK(expand("a[1-2],b,c[10-11]") == Hosts{"a1", "a2", "b", "c10", "c11"});
}

TEST_CASE("hostlist: malformed lists name the variable, the value and the fault") {
  CHECK(has(error_of([] { expand(""); }), "SLURM_STEP_NODELIST is empty"));
  CHECK(has(error_of([] { expand("node[1-3"); }), "'[' without ']'"));
  CHECK(has(error_of([] { expand("node1-3]"); }), "']' without '['"));
  CHECK(has(error_of([] { expand("node[3-1]"); }), "range '3-1' runs backwards"));
  CHECK(has(error_of([] { expand("node[a-b]"); }), "range 'a-b' is not N or N-M"));
  CHECK(has(error_of([] { expand("node[]"); }), "range '' is not N or N-M"));
  CHECK(has(error_of([] { expand("a,,b"); }), "an empty host name"));
  CHECK(has(error_of([] { expand("n[[1]]"); }), "nested '['"));
  std::string huge = error_of([] { expand_hostlist("n[1-100],m[1-100]", "SLURM_JOB_NODELIST", 150); });
  CHECK(has(huge, "SLURM_JOB_NODELIST='n[1-100],m[1-100]' names more than 150 hosts"));
  CHECK(has(error_of([] { expand_hostlist("n[0-99999999999]", "SLURM_JOB_NODELIST", 1000); }),
            "names more than 1000 hosts"));
  CHECK(has(error_of([] { expand_hostlist("n[0-9,20-29]", "SLURM_JOB_NODELIST", 15); }), "names more than 15 hosts"));
}

TEST_CASE("ports: derived ports stay in the documented range; steps of one job never collide") {
  std::set<uint16_t> ports;
  for (uint64_t step = 0; step < 32; ++step) {
    uint16_t port = slurm_derived_port(1234, step);
    CHECK(port >= kDerivedPortFirst);
    CHECK(port <= kDerivedPortLast);
    ports.insert(port);
  }
  CHECK(ports.size() == 32);
  // Jobs with nearby ids (submitted together) and all their first 32 steps: disjoint.
  for (uint64_t job = 1235; job < 1234 + 384; ++job) ports.insert(slurm_derived_port(job, 0));
  CHECK(ports.size() == 32 + 383);
  CHECK(slurm_derived_port(1234 + 384 * 1000, 5) == slurm_derived_port(1234, 5));
  CHECK(slurm_derived_port(UINT64_MAX, UINT64_MAX) <= kDerivedPortLast);
  CHECK(namespace_derived_port("3472359425") == namespace_derived_port("3472359425"));
  CHECK(namespace_derived_port("3472359425") != namespace_derived_port("3472359426"));
  CHECK(namespace_derived_port("prterun-vm-12345@1") >= kDerivedPortFirst);
}

TEST_CASE("rendezvous: Slurm gives the host, the port and a run id") {
  SUBCASE("derived port: every rank agrees on node01 and the job/step port") {
    for (int rank = 0; rank < 4; ++rank) {
      Rendezvous r = resolve_rendezvous(slurm_task(rank), slurm_membership(rank));
      CHECK(r.addr == "node01");
      CHECK(r.port == slurm_derived_port(1234, 3));
      CHECK(r.run_id == "slurm-1234.3");
      CHECK(r.launcher == "Slurm");
      CHECK(has(r.origin, "first host of SLURM_STEP_NODELIST=node[01-02]"));
      CHECK(has(r.origin, "SLURM_JOB_ID=1234 and SLURM_STEP_ID=3"));
    }
  }
  SUBCASE("reserved ports win over the derived one") {
    LaunchEnv e = slurm_task(1);
    e.slurm_step_resv_ports = "12001-12005";
    CHECK(resolve_rendezvous(e, slurm_membership(1)).port == 12001);
    e.slurm_step_resv_ports = "12006";
    CHECK(resolve_rendezvous(e, slurm_membership(1)).port == 12006);
    e.slurm_step_resv_ports = "12x";
    CHECK(has(error_of([&] { resolve_rendezvous(e, slurm_membership(1)); }), "SLURM_STEP_RESV_PORTS=12x"));
    // The whole value and what was expected, not the empty field before '-' (was "SLURM_STEP_RESV_PORTS= is
    // not a TCP port").
    for (const char* bad : {"-5", ",12001", "0-3", "70000", ""}) {
      e.slurm_step_resv_ports = bad;
      CHECK(error_of([&] { resolve_rendezvous(e, slurm_membership(1)); }) ==
            std::string("environment variable SLURM_STEP_RESV_PORTS=") + bad +
                " is not a list of TCP ports: expected a port (1 to 65535), a range N-M or a list N,M,... whose "
                "first port is the store's");
    }
    e.slurm_step_resv_ports = "12001,12005";
    CHECK(resolve_rendezvous(e, slurm_membership(1)).port == 12001);
  }
  SUBCASE("the job's node list when the step has none") {
    LaunchEnv e = slurm_task(2);
    e.slurm_step_nodelist.reset();
    e.slurm_job_nodelist = "gpu-a[7-8]x";
    e.slurmd_nodename = "gpu-a7x";
    CHECK(resolve_rendezvous(e, slurm_membership(2)).addr == "gpu-a7x");
    CHECK(resolve_rendezvous(e, slurm_membership(0)).addr == "gpu-a7x");
  }
  SUBCASE("explicit MASTER_ADDR and MASTER_PORT each win") {
    LaunchEnv e = slurm_task(0);
    e.master_port = "29500";
    Rendezvous r = resolve_rendezvous(e, slurm_membership(0));
    CHECK(r.addr == "node01");
    CHECK(r.port == 29500);
    e.master_addr = "10.0.0.1";
    r = resolve_rendezvous(e, slurm_membership(3));
    CHECK(r.addr == "10.0.0.1");
    CHECK(r.port == 29500);
    CHECK(r.run_id.empty());  // both explicit: nothing derived, as before
    e.run_id = "mine";
    e.master_port.reset();
    CHECK(resolve_rendezvous(e, slurm_membership(3)).run_id.empty());  // PSGD_RUN_ID wins
  }
  SUBCASE("rank 0 off the first host fails with both names") {
    LaunchEnv e = slurm_task(0);
    e.slurmd_nodename = "node02";
    std::string message = error_of([&] { resolve_rendezvous(e, slurm_membership(0)); });
    CHECK(has(message, "rank 0 runs on 'node02' (SLURMD_NODENAME)"));
    CHECK(has(message, "look for its store on 'node01'"));
    CHECK(has(message, "MASTER_ADDR"));
    // Without SLURMD_NODENAME the host name decides, its short form matching.
    e.slurmd_nodename.reset();
    CHECK(error_of([&] { resolve_rendezvous(e, slurm_membership(0)); }).empty());
    e.hostname = "login3";
    CHECK(has(error_of([&] { resolve_rendezvous(e, slurm_membership(0)); }), "'login3' (hostname)"));
    // Only rank 0 hosts the store, so only rank 0 checks.
    LaunchEnv other = slurm_task(2);
    other.slurmd_nodename = "elsewhere";
    CHECK(error_of([&] { resolve_rendezvous(other, slurm_membership(2)); }).empty());
  }
  SUBCASE("the batch script itself (no step) is told to use srun") {
    LaunchEnv e = slurm_task(0);
    e.slurm_step_id.reset();
    std::string message = error_of([&] { resolve_rendezvous(e, slurm_membership(0)); });
    CHECK(has(message, "rank and world size come from Slurm (SLURM_PROCID=0, SLURM_NTASKS=4)"));
    CHECK(has(message, "SLURM_STEP_ID unset"));
    CHECK(has(message, "srun -n 4 prog"));
    e.master_addr = "node01";  // the others would never come, whatever MASTER_* say
    e.master_port = "29500";
    CHECK(has(error_of([&] { resolve_rendezvous(e, slurm_membership(0)); }), "SLURM_STEP_ID unset"));
    // A batch script's single task (--ntasks=1) is a world of one.
    e.slurm_ntasks = "1";
    CHECK(error_of([&] { resolve_rendezvous(e, Membership{"SLURM_PROCID", "SLURM_NTASKS", 0, 1}); }).empty());
  }
  SUBCASE("a world of one in the batch script with only one of MASTER_ADDR/MASTER_PORT") {
    // SLURM_STEP_ID was dereferenced while unset (undefined behaviour; an abort under _GLIBCXX_ASSERTIONS).
    const Membership one{"SLURM_PROCID", "SLURM_NTASKS", 0, 1};
    LaunchEnv e = slurm_task(0);
    e.slurm_ntasks = "1";
    e.slurm_step_id.reset();
    e.master_addr = "node01";
    CHECK(error_of([&] { resolve_rendezvous(e, one); }) ==
          "Slurm: SLURM_STEP_ID unset (not a task of a job step, e.g. the batch script) and MASTER_PORT unset: "
          "cannot derive the store's port; set MASTER_PORT to a free port, or unset MASTER_ADDR (a world of one "
          "then uses a private store)");
    e.slurm_step_resv_ports = "12001";  // a port given another way: no step needed
    Rendezvous r = resolve_rendezvous(e, one);
    CHECK(r.port == 12001);
    CHECK(r.run_id == "slurm-1234.batch");
    e.slurm_step_resv_ports.reset();
    e.master_addr.reset();
    e.master_port = "29500";
    r = resolve_rendezvous(e, one);
    CHECK(r.addr == "node01");
    CHECK(r.port == 29500);
    CHECK(r.run_id == "slurm-1234.batch");
  }
  SUBCASE("no node list") {
    LaunchEnv e = slurm_task(1);
    e.slurm_step_nodelist.reset();
    e.slurm_job_nodelist.reset();
    CHECK(has(error_of([&] { resolve_rendezvous(e, slurm_membership(1)); }),
              "without SLURM_STEP_NODELIST or SLURM_JOB_NODELIST"));
  }
}

TEST_CASE("rendezvous: Open MPI on one node, and the error naming the fix on several") {
  for (int rank = 0; rank < 4; ++rank) {
    Rendezvous r = resolve_rendezvous(ompi_rank(rank), ompi_membership(rank));
    CHECK(r.addr == "127.0.0.1");
    CHECK(r.port == namespace_derived_port("3472359425"));
    CHECK(r.run_id == "ompi-3472359425");
    CHECK(r.launcher == "Open MPI");
  }
  LaunchEnv pmix_only = ompi_rank(1);
  pmix_only.ompi_jobid.reset();
  pmix_only.pmix_namespace = "prterun-vm-4242@1";
  CHECK(resolve_rendezvous(pmix_only, ompi_membership(1)).port == namespace_derived_port("prterun-vm-4242@1"));

  std::string message = error_of([] { resolve_rendezvous(ompi_rank(3, "2"), ompi_membership(3)); });
  CHECK(has(message, "Open MPI job over several nodes (OMPI_COMM_WORLD_LOCAL_SIZE=2, OMPI_COMM_WORLD_SIZE=4)"));
  CHECK(has(message, "mpirun -x MASTER_ADDR -x MASTER_PORT"));
  CHECK(has(message, "powersgd-run"));
  // Several nodes with an explicit MASTER_ADDR: the port may still be derived.
  LaunchEnv e = ompi_rank(3, "2");
  e.master_addr = "node01";
  Rendezvous r = resolve_rendezvous(e, ompi_membership(3));
  CHECK(r.addr == "node01");
  CHECK(r.port == namespace_derived_port("3472359425"));
}

TEST_CASE("rendezvous: RANK/WORLD_SIZE without MASTER_* names the launcher detected and the fix") {
  Membership by_hand{"RANK", "WORLD_SIZE", 1, 4};
  std::string plain = error_of([&] { resolve_rendezvous(LaunchEnv{}, by_hand); });
  CHECK(has(plain, "MASTER_ADDR is not set"));
  CHECK(has(plain, "powersgd-run, torchrun, srun or mpirun"));
  LaunchEnv addr_only;
  addr_only.master_addr = "127.0.0.1";
  CHECK(has(error_of([&] { resolve_rendezvous(addr_only, by_hand); }), "MASTER_PORT is not set"));
  std::string in_slurm = error_of([&] { resolve_rendezvous(slurm_task(1), by_hand); });
  CHECK(has(in_slurm, "a Slurm task (SLURM_PROCID=1)"));
  CHECK(has(in_slurm, "unset RANK and WORLD_SIZE"));
  std::string in_ompi = error_of([&] { resolve_rendezvous(ompi_rank(1), by_hand); });
  CHECK(has(in_ompi, "started by Open MPI (OMPI_COMM_WORLD_RANK=1)"));
  std::string pmi = error_of([&] { resolve_rendezvous(LaunchEnv{}, Membership{"PMI_RANK", "PMI_SIZE", 1, 4}); });
  CHECK(has(pmi, "mpiexec -genv MASTER_ADDR"));
  // A world of one needs nothing; MASTER_PORT out of range names the value.
  CHECK(resolve_rendezvous(LaunchEnv{}, Membership{"RANK", "WORLD_SIZE", 0, 1}).port == 0);
  LaunchEnv bad_port;
  bad_port.master_addr = "127.0.0.1";
  bad_port.master_port = "70000";
  CHECK(has(error_of([&] { resolve_rendezvous(bad_port, by_hand); }), "MASTER_PORT=70000"));
}

TEST_CASE("rendezvous: under powersgd-run the launcher's PSGD_STORE_ADDR/PSGD_STORE_PORT win over torch's MASTER_*") {
  Membership worker{"RANK", "WORLD_SIZE", 1, 2};
  LaunchEnv e;
  e.master_addr = "127.0.0.1";
  e.master_port = "12345";  // torch.distributed's TCPStore, hosted by its rank 0
  e.store_addr = "10.77.0.254";
  e.store_port = "40000";
  e.launcher_hosted = true;
  Rendezvous r = resolve_rendezvous(e, worker);
  CHECK(r.addr == "10.77.0.254");
  CHECK(r.port == 40000);
  CHECK(has(r.origin, "PSGD_STORE_PORT"));
  e.store_port = "70000";
  CHECK(has(error_of([&] { resolve_rendezvous(e, worker); }), "PSGD_STORE_PORT=70000"));
  // Without PSGD_STORE_HOSTED=1 (torchrun, a user's PSGD_STORE_PORT for the C API beside torch) MASTER_* rule.
  e.launcher_hosted = false;
  r = resolve_rendezvous(e, worker);
  CHECK(r.addr == "127.0.0.1");
  CHECK(r.port == 12345);
  // A launcher that sets only MASTER_* (an older powersgd-run) still works.
  e.launcher_hosted = true;
  e.store_addr.reset();
  e.store_port.reset();
  CHECK(resolve_rendezvous(e, worker).port == 12345);
}

TEST_CASE("inherited RANK: warned when it differs from the launcher's rank while the sizes agree") {
  // A batch script exported RANK=$SLURM_PROCID (0) before srun: task 2 got RANK=0.
  LaunchEnv e = slurm_task(2);
  Membership inherited{"RANK", "WORLD_SIZE", 0, 4};
  auto warning = inherited_rank_warning(e, inherited);
  REQUIRE(warning.has_value());
  CHECK(has(*warning, "RANK=0 differs from SLURM_PROCID=2 while WORLD_SIZE=4 and SLURM_NTASKS=4 agree"));
  CHECK(has(*warning, "unset RANK and WORLD_SIZE"));
  // Agreeing ranks, other sizes (torchrun with several processes per task),
  // powersgd-run's workers, the batch script's children: no warning.
  CHECK_FALSE(inherited_rank_warning(e, Membership{"RANK", "WORLD_SIZE", 2, 4}));
  CHECK_FALSE(inherited_rank_warning(e, Membership{"RANK", "WORLD_SIZE", 0, 8}));
  LaunchEnv hosted = e;
  hosted.launcher_hosted = true;
  CHECK_FALSE(inherited_rank_warning(hosted, inherited));
  LaunchEnv torchrun = e;
  torchrun.torchrun = true;
  CHECK_FALSE(inherited_rank_warning(torchrun, inherited));
  LaunchEnv batch = e;
  batch.slurm_step_id.reset();
  CHECK_FALSE(inherited_rank_warning(batch, inherited));
  CHECK_FALSE(inherited_rank_warning(e, slurm_membership(2)));
  // Open MPI alike.
  auto ompi = inherited_rank_warning(ompi_rank(3), inherited);
  REQUIRE(ompi.has_value());
  CHECK(has(*ompi, "differs from OMPI_COMM_WORLD_RANK=3"));
}

int main(int argc, char** argv) { return powersgd::testing::run_selected_tests(argc, argv); }
