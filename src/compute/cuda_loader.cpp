// The library's side of the CUDA module (cuda_module.hpp): finds
// libpowersgd-cuda.so, loads it with dlopen on the first request for a CUDA
// backend, checks that it belongs to this library, and explains in an
// UnsupportedError what is missing when it cannot be used: the module, the CUDA
// libraries it needs, or a GPU. Nothing here touches CUDA, so CPU use never
// depends on it.
#include <dlfcn.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "common/check.hpp"
#include "common/env.hpp"
#include "compute/backend.hpp"
#include "compute/cuda_module.hpp"
#include "powersgd_build_config.h"

namespace powersgd::compute {
namespace {

constexpr const char* kModuleName = PSGD_CUDA_MODULE_NAME;

// Every message starts so; the words after it name what is missing.
constexpr const char* kUnavailable = "CUDA backend unavailable: ";

// An object of this library, for dladdr.
const char kAnchor = 0;

// The directory of the object that holds this code (libpowersgd.so, or the
// program itself when it links the compute layer statically), canonical, so
// the module's path names one file however the library was found.
std::string own_directory() {
  Dl_info info{};
  if (dladdr(&kAnchor, &info) == 0 || info.dli_fname == nullptr || *info.dli_fname == '\0') return {};
  char resolved[PATH_MAX];
  if (realpath(info.dli_fname, resolved) == nullptr) return {};
  std::string path(resolved);
  return path.substr(0, path.rfind('/'));
}

struct Candidate {
  std::string path;  // a file path, or the bare name for the loader's search
  bool bare_name;
  std::string origin;  // how the path was chosen, for the message
};

// Lookup order (docs/compute.md): PSGD_CUDA_MODULE alone when set; else beside
// this library, then the dynamic loader's search path.
std::vector<Candidate> candidates() {
  if (auto path = env::get("PSGD_CUDA_MODULE")) return {{*path, false, "PSGD_CUDA_MODULE="}};
  std::vector<Candidate> list;
  if (const std::string dir = own_directory(); !dir.empty())
    list.push_back({dir + "/" + kModuleName, false, "beside libpowersgd: "});
  list.push_back({kModuleName, true, ""});
  return list;
}

[[noreturn]] void module_missing(const std::vector<std::string>& tried) {
  std::string looked;
  for (const auto& place : tried) looked += (looked.empty() ? "" : "; ") + place;
  PSGD_THROW(UnsupportedError, kUnavailable, "missing the CUDA module ", kModuleName, " (looked for: ", looked,
             "). ",
             PSGD_HAVE_CUDA ? "Install it beside libpowersgd.so (this build makes it with the library) or set "
                              "PSGD_CUDA_MODULE to its path"
                            : "This build was configured without CUDA (-Dcuda=disabled or no toolkit): rebuild "
                              "with -Dcuda=enabled, or set PSGD_CUDA_MODULE to the module of a CUDA build of "
                              "powersgd " PSGD_VERSION);
}

[[noreturn]] void libraries_missing(const std::string& module, const std::string& loader_error) {
  PSGD_THROW(UnsupportedError, kUnavailable, "missing the CUDA libraries that ", module,
             " needs: ", loader_error, ". Install the CUDA runtime libraries (cudart, cuBLAS, cuSOLVER)",
             *PSGD_CUDA_TOOLKIT ? " of " PSGD_CUDA_TOOLKIT : "",
             " and make them findable: LD_LIBRARY_PATH or ldconfig; CPU use is not affected");
}

[[noreturn]] void mismatch(const std::string& module, const std::string& why) {
  PSGD_THROW(UnsupportedError, kUnavailable, "the CUDA module ", module,
             " does not belong to this library (powersgd " PSGD_VERSION ", compute seam ABI ", kComputeSeamAbi,
             "): ", why, ". Install the ", kModuleName, " built together with this libpowersgd.so");
}

// dlopen's message names the object it could not load first.
bool names_object(const std::string& loader_error, const std::string& object) {
  return loader_error.rfind(object + ":", 0) == 0;
}

// Closes a module handle unless released: whatever a failed request loaded
// (the module and, through it, the CUDA libraries: some 260 MB) leaves the
// process with it. RTLD_LOCAL keeps the module's dependencies out of the global
// scope, so nothing else holds them once the module goes.
class ModuleHandle {
 public:
  explicit ModuleHandle(void* handle) : handle_(handle) {}
  ~ModuleHandle() {
    if (handle_ != nullptr) dlclose(handle_);
  }
  ModuleHandle(const ModuleHandle&) = delete;
  ModuleHandle& operator=(const ModuleHandle&) = delete;
  void* get() const { return handle_; }
  void release() { handle_ = nullptr; }

 private:
  void* handle_;
};

const CudaModuleTable& open_module(const std::string& path, void* handle) {
  auto entry = reinterpret_cast<psgd_cuda_module_entry>(dlsym(handle, kCudaModuleEntryPoint));
  if (entry == nullptr)
    mismatch(path, detail::concat("it has no entry point ", kCudaModuleEntryPoint,
                                  " (a module of another compute seam version, or not a powersgd module)"));
  const CudaModuleTable* table = entry();
  if (table->seam_abi != kComputeSeamAbi || std::strcmp(table->version, PSGD_VERSION) != 0)
    mismatch(path, detail::concat("it is powersgd ", table->version, " with compute seam ABI ", table->seam_abi));
  return *table;
}

// Loads the module, checks that it belongs to this library and that it sees a
// GPU. Once all hold, the module stays loaded for the life of the process: its
// backends' code lives there, and the CUDA libraries do not support unloading
// after use. A request that fails unloads what it loaded; the next request
// loads again and fails with the same message.
const CudaModuleTable& usable_module() {
  static std::mutex mutex;
  static const CudaModuleTable* usable = nullptr;
  std::lock_guard lock(mutex);
  if (usable != nullptr) return *usable;
  std::vector<std::string> tried;
  for (const auto& candidate : candidates()) {
    if (!candidate.bare_name && access(candidate.path.c_str(), F_OK) != 0) {
      tried.push_back(candidate.origin + candidate.path + " (" + detail::errno_text(errno) + ")");
      continue;
    }
    dlerror();
    ModuleHandle handle(dlopen(candidate.path.c_str(), RTLD_NOW | RTLD_LOCAL));
    if (handle.get() == nullptr) {
      const char* text = dlerror();
      const std::string error = text != nullptr ? text : "unknown dlopen error";
      if (candidate.bare_name && names_object(error, candidate.path)) {
        tried.push_back(candidate.path + " on the loader's search path (LD_LIBRARY_PATH, ldconfig): not found");
        continue;
      }
      // The module file is there but is not a loadable object of this machine.
      if (names_object(error, candidate.path)) mismatch(candidate.path, error);
      libraries_missing(candidate.path, error);
    }
    const CudaModuleTable& table = open_module(candidate.path, handle.get());
    char reason[512] = {};
    PSGD_REQUIRE(table.device_count(reason, sizeof reason) > 0, UnsupportedError, kUnavailable, "missing a GPU: ",
                 reason);
    handle.release();
    usable = &table;
    return table;
  }
  module_missing(tried);
}

}  // namespace

std::string cuda_unavailable_reason() {
  try {
    usable_module();
    return {};
  } catch (const Error& e) {
    return e.what();
  }
}

bool cuda_available() { return cuda_unavailable_reason().empty(); }

std::unique_ptr<Backend> make_cuda_backend(int device_index) { return usable_module().create(device_index); }

}  // namespace powersgd::compute
