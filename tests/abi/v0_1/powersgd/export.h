/* tests/abi: include/powersgd/export.h of powersgd 0.1 (commit f100d22, the last before 0.2's fields), unchanged below
 * this comment. Old callers are compiled against it (tests/abi/meson.build): never edit. */
/* PSGD_API marks what libpowersgd exports: the C API, the public C++ classes
 * and functions. Everything else in the library is built with hidden visibility
 * (meson: gnu_symbol_visibility), so the shared library's ABI is exactly what
 * include/powersgd declares. C99 and C++. */
#ifndef POWERSGD_EXPORT_H
#define POWERSGD_EXPORT_H

#if defined(__GNUC__) || defined(__clang__)
#define PSGD_API __attribute__((visibility("default")))
#else
#define PSGD_API
#endif

#endif /* POWERSGD_EXPORT_H */
