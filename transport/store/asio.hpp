// Boost.Asio for the TCP store, with the workarounds Debian 12's Boost 1.74
// needs under this project's flags. Private to transport/store.
#pragma once

// asio/awaitable.hpp uses std::exchange without including <utility> (C++20).
#include <utility>

// Asio orders handler hand-offs with std::atomic_thread_fence, which GCC 12
// flags under -fsanitize=thread (-Wtsan, an error with werror). ThreadSanitizer
// still sees the mutexes Asio's scheduler takes around every hand-off.
#if defined(__SANITIZE_THREAD__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wtsan"
#endif
#include <boost/asio.hpp>
#if defined(__SANITIZE_THREAD__)
#pragma GCC diagnostic pop
#endif
