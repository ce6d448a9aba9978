/* The powersgd version this header belongs to. meson.build refuses to configure
 * when these differ from the project's version; psgd_version() (powersgd.h)
 * tells which library a program runs against. C99 and C++. */
#ifndef POWERSGD_VERSION_H
#define POWERSGD_VERSION_H

#define PSGD_VERSION_MAJOR 0
#define PSGD_VERSION_MINOR 2
#define PSGD_VERSION_PATCH 0
/* One number for comparisons: 10000 * major + 100 * minor + patch. */
#define PSGD_VERSION_NUMBER (10000 * PSGD_VERSION_MAJOR + 100 * PSGD_VERSION_MINOR + PSGD_VERSION_PATCH)

#endif /* POWERSGD_VERSION_H */
