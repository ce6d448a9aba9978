#include <fstream>

#include "bench.hpp"
#include "powersgd/error.hpp"

namespace powersgd::bench {

void write_json(const std::string& path, const nlohmann::json& doc, const std::string& subcommand) {
  std::ofstream out(path);
  out << doc.dump(2) << "\n";
  if (!out) throw IoError("powersgd-bench " + subcommand + ": cannot write " + path);
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
  CLI11_PARSE(app, argc, argv);
  return 0;
}
