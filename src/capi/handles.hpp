// The C API's communicator handle, shared by the files of the capi layer.
#pragma once

#include <memory>

#include "powersgd/comm.hpp"

struct psgd_comm {
  // Held by the communicator that hosts the beside-torch store in this process (create_beside_torch); declared
  // first so that it is released after comm, whose destruction stops the store server.
  std::shared_ptr<void> store_host;
  std::unique_ptr<powersgd::Communicator> comm;
};
