// Gloo transport devices (tcp, ibverbs). Private to transport.
#pragma once

#include <gloo/transport/device.h>

#include <memory>

#include "powersgd/comm.hpp"

namespace powersgd::transport {

// The device for options.transport. TCP binds options.iface or
// options.address (validated first: Debian's Gloo has undefined behaviour on an
// unresolvable hostname). Throws InvalidArgumentError for a bad interface or
// address, UnsupportedError when ibverbs is not built in or no RDMA device exists.
std::shared_ptr<gloo::transport::Device> make_device(const CommOptions& options);

}  // namespace powersgd::transport
