#include <algorithm>
#include <cstdio>
#include <exception>
#include <fstream>
#include <string>

#include "bench.hpp"
#include "powersgd/error.hpp"

namespace powersgd::bench {

void write_json(const std::string& path, const nlohmann::json& doc, const std::string& subcommand) {
  std::ofstream out(path);
  out << doc.dump(2) << "\n";
  if (!out) throw IoError("powersgd-bench " + subcommand + ": cannot write " + path);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t half = v.size() / 2;
  return v.size() % 2 == 1 ? v[half] : (v[half - 1] + v[half]) / 2;
}

}  // namespace powersgd::bench

int main(int argc, char** argv) {
  CLI::App app{"powersgd-bench: benchmarks of the powersgd transport and engine.\n"
               "Multi-rank benchmarks run under powersgd-run, e.g.\n"
               "  powersgd-run -n 4 -- powersgd-bench allreduce"};
  app.require_subcommand(1);
  powersgd::bench::add_allreduce_command(app);
  powersgd::bench::add_engine_command(app);
  powersgd::bench::add_sweep_command(app);
  // A subcommand's failure (a library error: a bad --mode, a missing file, a lost peer) is one line and exit 1,
  // never an escaped exception (std::terminate, SIGABRT).
  try {
    CLI11_PARSE(app, argc, argv);
  } catch (const std::exception& e) {
    const std::string what = e.what();
    const std::string name = "powersgd-bench " + app.get_subcommands().front()->get_name() + ": ";
    std::fprintf(stderr, "%s%s\n", what.rfind("powersgd-bench", 0) == 0 ? "" : name.c_str(), what.c_str());
    return 1;
  }
  return 0;
}
