#include "log.hpp"

#include <atomic>
#include <cstdio>
#include <mutex>

#include "env.hpp"

namespace powersgd::log {
namespace {

std::atomic<int> g_rank{-1};

Level level_from_env() {
  std::string text = env::get_or_default("PSGD_LOG_LEVEL");
  if (text == "error") return Level::Error;
  if (text == "info") return Level::Info;
  if (text == "debug") return Level::Debug;
  // Logging cannot refuse a value, so an unknown one is said once (a typo would otherwise hide every info line).
  if (text != "warn")
    std::fprintf(stderr, "powersgd warn: PSGD_LOG_LEVEL='%s' is not error, warn, info or debug; logging at warn\n",
                 text.c_str());
  return Level::Warn;
}

}  // namespace

bool enabled(Level level) {
  static const Level threshold = level_from_env();
  return static_cast<int>(level) <= static_cast<int>(threshold);
}

void write(Level level, const std::string& message) {
  static std::mutex mutex;
  static const char* const names[] = {"error", "warn", "info", "debug"};
  std::lock_guard lock(mutex);
  int rank = g_rank.load();
  if (rank >= 0)
    std::fprintf(stderr, "powersgd[%d] %s: %s\n", rank, names[static_cast<int>(level)], message.c_str());
  else
    std::fprintf(stderr, "powersgd %s: %s\n", names[static_cast<int>(level)], message.c_str());
}

void set_rank(int rank) { g_rank.store(rank); }

}  // namespace powersgd::log
