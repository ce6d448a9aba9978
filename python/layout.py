"""Configure-time helper of python/powersgd/meson.build: where `meson install` puts the package and how each
copy of the package reaches libpowersgd, always relative to the package's own directory (no absolute path is
baked in, so DESTDIR installs, a moved prefix and wheels work).

    layout.py BUILD_PACKAGE_DIR BUILD_LIBRARY SITE_DIR KEEP_SITE_DIR PREFIX INSTALLED_LIBRARY

Prints three lines: the build-tree library relative to BUILD_PACKAGE_DIR; the site directory to install the
package into; INSTALLED_LIBRARY relative to that site directory's powersgd/.

SITE_DIR is Meson's python.get_install_dir(). Meson 1.0 applies Debian's scheme for /usr to every prefix, so
for /usr/local it answers /usr/local/lib/python3/dist-packages, which Debian's python3 does not search (it
searches /usr/local/lib/python3.X/dist-packages). Unless KEEP_SITE_DIR is "true" (a wheel, or
-Dpython.platlibdir given), a SITE_DIR that is not on this interpreter's sys.path gives way to
PREFIX/lib/python3.X/{dist,site}-packages when that one is.
"""
import os
import sys

build_package_dir, build_library, site_dir, keep_site_dir, prefix, installed_library = sys.argv[1:7]

search_path = {os.path.normpath(p) for p in sys.path if p}
if keep_site_dir != "true" and os.path.normpath(site_dir) not in search_path:
    versioned = os.path.join(prefix, "lib", "python%d.%d" % sys.version_info[:2])
    for candidate in (os.path.join(versioned, "dist-packages"), os.path.join(versioned, "site-packages")):
        if os.path.normpath(candidate) in search_path:
            site_dir = candidate
            break

print(os.path.relpath(build_library, build_package_dir))
print(site_dir)
print(os.path.relpath(installed_library, os.path.join(site_dir, "powersgd")))
