#!/usr/bin/env bash
# Installs what is missing (Debian 12, apt-get, idempotent), then configures and
# builds one build directory.
#   scripts/setup.sh [--configure-only] BUILD_DIR [meson options...]
# --configure-only: no build; `meson test` then builds only what the tests it runs need.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(build-essential meson ninja-build pkg-config python3 cmake
          libgloo-dev libopenblas-dev libboost-dev doctest-dev libibverbs-dev
          libcli11-dev nlohmann-json3-dev zlib1g-dev abigail-tools
          iproute2 iptables libnetfilter-queue-dev openssh-server openssh-client iperf3 procps
          slurmctld slurmd slurm-client munge openmpi-bin
          clang libclang-rt-14-dev
          dataset-fashion-mnist python3-torch python3-torchvision
          python3-venv python3-mesonpy)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  # env inside sudo: sudo resets the environment, so an exported DEBIAN_FRONTEND did not reach apt (iperf3's
  # debconf question then waited on a terminal). An install interrupted before is finished first; a changed
  # configuration file keeps the local version without asking.
  sudo_cmd=(env DEBIAN_FRONTEND=noninteractive)
  [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo env DEBIAN_FRONTEND=noninteractive)
  "${sudo_cmd[@]}" dpkg --configure -a
  "${sudo_cmd[@]}" apt-get update -qq
  "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends -o Dpkg::Options::=--force-confdef \
    -o Dpkg::Options::=--force-confold "${missing[@]}"
fi

# The CUDA toolkit is not a Debian package: use it when /usr/local/cuda has one.
if [ -x /usr/local/cuda/bin/nvcc ]; then export PATH="/usr/local/cuda/bin:$PATH"; fi

configure_only=0
if [ "${1:-}" = "--configure-only" ]; then
  configure_only=1
  shift
fi
build_dir=${1:?usage: scripts/setup.sh [--configure-only] BUILD_DIR [meson options...]}
shift
if [ -f "$build_dir/build.ninja" ]; then
  [ $# -eq 0 ] || meson configure "$build_dir" "$@" >/dev/null
else
  meson setup "$build_dir" "$@"
fi
[ $configure_only -eq 1 ] || ninja -C "$build_dir"
