#!/usr/bin/env bash
# Installs the Debian 12 packages voltaforge's tests need: a real sshd, debootstrap and
# systemd-nspawn for the systemd test host, zstd for its cached rootfs, Debian's CUDA 11.8
# (non-free) so the sm_70 build environment can be proven against a real toolkit, the C/C++
# build tools for llama.cpp (cmake, make, g++), systemd for `systemd-analyze security`, and
# HAProxy, the load balancer `invoke lb` renders a configuration for (the tests run it), and
# numpy for the test hosts' python3 (the membw probe's copy rate: a pure-Python one is a lower
# bound the bench refuses as a ceiling; a provisioned host has it in its toolchain venv), and
# strace, which records every exec while keyed runs go (tests/exec_trace.py: no key in an argv).
# (The CUDA 13 nvcc the mixed-toolkit tests need comes from PyPI: ci/install-cuda13-nvcc.sh.)
# Idempotent: re-running installs nothing new.
set -eu
export DEBIAN_FRONTEND=noninteractive
src=/etc/apt/sources.list.d/voltaforge-nonfree.sources
if [ ! -f "$src" ]; then
    cat >"$src" <<'SRC'
# Added by voltaforge ci/install-system-deps.sh: CUDA 11.8 lives in Debian's non-free component.
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: contrib non-free
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
fi
pkgs="python3-venv openssh-server openssh-client debootstrap systemd systemd-container zstd iproute2 sudo cmake make g++ nvidia-cuda-toolkit ccache haproxy python3-numpy strace prometheus prometheus-node-exporter python3-prometheus-client"
missing=""
for p in $pkgs; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
    apt-get update -qq
    # Debian's prometheus and node exporter start themselves on install, on every interface:
    # policy-rc.d (101: "not allowed") keeps them stopped here, as `invoke monitor` does on a host
    policy=/usr/sbin/policy-rc.d
    [ -e "$policy" ] && had_policy=1 || { printf '#!/bin/sh\nexit 101\n' > "$policy"; chmod 755 "$policy"; }
    # shellcheck disable=SC2086
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing
    [ -n "${had_policy:-}" ] || rm -f "$policy"
fi
