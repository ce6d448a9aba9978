// powersgd-bench subcommands. Each registers itself on the CLI11 app; results
// print as a table and, with --json FILE, as machine-readable JSON.
#pragma once

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace powersgd::bench {

void add_allreduce_command(CLI::App& app);  // allreduce.cpp: bus bandwidth and latency vs size
void add_engine_command(CLI::App& app);     // engine.cpp: PowerSGD step time on model shapes
void add_sweep_command(CLI::App& app);      // sweep.cpp: approximation error vs bytes per step, per rank

// Writes `doc` as indented JSON to `path`; IoError naming the subcommand and the path.
void write_json(const std::string& path, const nlohmann::json& doc, const std::string& subcommand);
// The median of `v` (not empty): the mean of the middle two for an even count.
double median(std::vector<double> v);

}  // namespace powersgd::bench
