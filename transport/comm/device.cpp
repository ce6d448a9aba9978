#include "comm/device.hpp"

#include <gloo/transport/tcp/attr.h>
#include <gloo/transport/tcp/device.h>
#include <net/if.h>

#include "comm/address.hpp"
#include "common/check.hpp"
#include "powersgd_build_config.h"

#if PSGD_HAVE_IBVERBS
#include <gloo/transport/ibverbs/device.h>
#include <infiniband/verbs.h>
#endif

namespace powersgd::transport {
namespace {

std::shared_ptr<gloo::transport::Device> make_tcp_device(const CommOptions& options) {
  gloo::transport::tcp::attr attr;
  if (!options.iface.empty()) {
    PSGD_REQUIRE(if_nametoindex(options.iface.c_str()) != 0, InvalidArgumentError, "PSGD_IFACE='", options.iface,
                 "' is not a network interface of this host");
    attr.iface = options.iface;
  } else {
    PSGD_REQUIRE(!options.address.empty(), InvalidArgumentError,
                 "the TCP transport needs an interface or address: set PSGD_IFACE or PSGD_ADDR");
    require_bindable(options.address);
    attr.hostname = options.address;
  }
  return gloo::transport::tcp::CreateDevice(attr);
}

#if PSGD_HAVE_IBVERBS
std::shared_ptr<gloo::transport::Device> make_ibverbs_device(const CommOptions& options) {
  int count = 0;
  ibv_device** list = ibv_get_device_list(&count);
  if (list != nullptr) ibv_free_device_list(list);
  PSGD_REQUIRE(list != nullptr && count > 0, UnsupportedError,
               "no RDMA device found (ibv_get_device_list returned none); use PSGD_TRANSPORT=tcp");
  gloo::transport::ibverbs::attr attr;
  attr.name = options.ib_device;
  attr.port = options.ib_port;
  attr.index = options.ib_gid_index;
  try {
    return gloo::transport::ibverbs::CreateDevice(attr);
  } catch (const std::exception& e) {
    PSGD_THROW(UnsupportedError, "cannot open ibverbs device '", options.ib_device.empty() ? "(first)" : options.ib_device,
               "' port ", options.ib_port, " GID index ", options.ib_gid_index, ": ", e.what(),
               " (check PSGD_IB_DEVICE, PSGD_IB_PORT, PSGD_IB_GID_INDEX, or use PSGD_TRANSPORT=tcp)");
  }
}
#endif

}  // namespace

std::shared_ptr<gloo::transport::Device> make_device(const CommOptions& options) {
  switch (options.transport) {
    case TransportKind::Tcp:
      return make_tcp_device(options);
    case TransportKind::Ibverbs:
#if PSGD_HAVE_IBVERBS
      return make_ibverbs_device(options);
#else
      PSGD_THROW(UnsupportedError, "PSGD_TRANSPORT=ibverbs, but powersgd was built without ibverbs "
                                   "(rebuild with -Dibverbs=enabled, or use PSGD_TRANSPORT=tcp)");
#endif
  }
  PSGD_ASSERT(false, "unknown transport ", static_cast<int>(options.transport));
  __builtin_unreachable();
}

}  // namespace powersgd::transport
