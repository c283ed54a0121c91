#!/usr/bin/env bash
# Builds the Debian 12 (bookworm) root filesystem that tests/testhosts.py boots with
# systemd-nspawn (the `nspawn_host` fixture), and caches it as a zstd tarball:
#
#     ${VOLTAFORGE_CACHE:-$HOME/.cache/voltaforge}/rootfs-bookworm-v3.tar.zst
#
# The name carries the image's version: bump it whenever the package list or the changes
# below change, so every cache (developer machines, CI) builds the new image instead of
# booting the old one (tests/testhosts.py names the same file: ROOTFS_TARBALL).
# v1 (rootfs-bookworm.tar.zst): a bootable host; v2: plus what provisioning the tiny-cpu
# recipe needs on a host without internet (build-essential, cmake, ccache, python3-venv);
# v3: plus haproxy, the package `invoke lb` installs (the container has no apt source to reach).
#
# Idempotent: if the tarball exists, nothing is done (pass --force to rebuild).
# Needs root, debootstrap, zstd and network access to a Debian mirror. Measured for v2 on
# this kind of machine (2 cores shared with other work, deb.debian.org): 75 s idle to 225 s
# under load (debootstrap 65-141 s, the rest tar + zstd); 630 MB unpacked, a 183 MB tarball,
# unpacked by the fixture in about 8 s. (v1 took about 2 min: 270 MB, an 85 MB tarball.)
#
# Mirror: $VOLTAFORGE_DEBIAN_MIRROR, else the first `URIs:` (deb822) or `deb` line for
# debian (not debian-security) found under /etc/apt, else http://deb.debian.org/debian.
#
# What the image contains and why:
#   systemd systemd-sysv dbus  a real init, so tests exercise systemctl/journalctl for real
#   openssh-server             the only way voltaforge talks to a host
#   python3 curl iproute2      what provisioning and the tests run on the host
#   sudo                       the `deploy` user provisions through sudo, like on real hosts
#   ca-certificates            so HTTPS clients inside behave like on a real host
#   libnss-myhostname          resolves the container's own hostname without DNS: without it
#                              (and nspawn's --resolv-conf=delete) every `sudo` inside stalls
#                              ~20 s waiting for a DNS server that does not exist.
# What `invoke toolchain`/`build`/`quantize` of a CPU recipe need on the host: exactly the
# toolchain step's BUILD_PACKAGES (playbooks/steps/build/toolchain.py), which it apt-installs when
# missing; the container has no internet, so they must already be here (curl is above).
# Python packages come from a wheelhouse the tests bind-mount (tests/wheelhouse.py).
#   build-essential            gcc, g++, make, libc6-dev: compiles llama.cpp (make is cmake's
#                              generator for the server) and the llama-cpp-python bindings;
#                              `gcc --version` is a build input
#   haproxy                    what `invoke lb` apt-installs (Debian's package), already here
#                              because the container reaches no apt source
#   cmake                      configures llama.cpp (3.25; the bindings' scikit-build-core
#                              wants >= 3.21, else it would pip-install a cmake wheel)
#   ccache                     the build step uses it when present (CCACHE_DIR under the
#                              prefix): rebuilds with other flags, and tests sharing one cache
#   python3-venv               `python3 -m venv` (EnsureVenv): Debian's python3 has no ensurepip
#                              without it
# Not needed (tests/test_provision_real.py provisions the container without them): git (llama.cpp's build info
# is "unknown" without it; the vendored tree is no git checkout anyway), pkg-config,
# python3-dev (the bindings load libllama with ctypes), ninja (scikit-build-core asks pip for
# `ninja>=1.5` here, and no cmake wheel since cmake 3.25 is enough: the wheelhouse has it).
# Changes after debootstrap and why:
#   /etc/hostname removed      nspawn --hostname= then names the machine
#   /etc/machine-id emptied    the fixture writes a fresh one per boot (no shared identity)
#   SSH host keys removed      the fixture generates one per boot and writes it into the
#                              rootfs before booting, so the client knows it in advance
#                              (strict host-key checking, no trust-on-first-use)
#   password logins off        key-only SSH, like a hardened server
#   user `deploy`              unprivileged login user with passwordless sudo; the fixture
#                              puts the session's public key in its (and root's)
#                              authorized_keys
set -euo pipefail

force=0
case "${1:-}" in
    --force) force=1 ;;
    "") ;;
    *) echo "usage: $0 [--force]" >&2; exit 2 ;;
esac

cache="${VOLTAFORGE_CACHE:-$HOME/.cache/voltaforge}"
tarball="$cache/rootfs-bookworm-v3.tar.zst"
suite=bookworm
packages="systemd,systemd-sysv,dbus,openssh-server,python3,curl,iproute2,sudo,libnss-myhostname,ca-certificates"
packages="$packages,build-essential,cmake,ccache,python3-venv"
# installed by apt after debootstrap: in --include, haproxy's dependency on adduser made
# debootstrap extract adduser twice ("Tried to extract package, but file already exists")
late_packages="haproxy"

if [ -s "$tarball" ] && [ "$force" = 0 ]; then
    echo "build-test-rootfs: $tarball exists, nothing to do"
    exit 0
fi

if [ "$(id -u)" != 0 ]; then
    echo "build-test-rootfs: must run as root (debootstrap)" >&2
    exit 1
fi
for tool in debootstrap zstd tar chroot flock; do
    command -v "$tool" >/dev/null || { echo "build-test-rootfs: $tool not found" >&2; exit 1; }
done

detect_mirror() {
    local uri
    # deb822 sources: the URIs of the stanza whose URIs end in /debian
    uri=$(grep -hE '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null \
        | awk '{for (i = 2; i <= NF; i++) print $i}' | grep -E '/debian/?$' | head -n1 || true)
    if [ -z "$uri" ]; then
        uri=$(grep -hE '^deb[[:space:]]' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
            | awk '{ for (i = 2; i <= NF; i++) if ($i !~ /^\[/) { print $i; break } }' \
            | grep -E '/debian/?$' | head -n1 || true)
    fi
    echo "${uri:-http://deb.debian.org/debian}"
}
mirror="${VOLTAFORGE_DEBIAN_MIRROR:-$(detect_mirror)}"

mkdir -p "$cache"
# One builder at a time (parallel CI jobs sharing a cache wait for the first one).
exec 9>"$cache/.rootfs-bookworm-v3.lock"
flock 9
if [ -s "$tarball" ] && [ "$force" = 0 ]; then
    echo "build-test-rootfs: $tarball was built meanwhile, nothing to do"
    exit 0
fi

work=$(mktemp -d "$cache/rootfs-build.XXXXXX")
rootfs="$work/rootfs"
cleanup() {
    set +e  # best effort: a failing step here must not skip the removal below
    # debootstrap mounts proc/sys inside the target; a failed run can leave them behind.
    if command -v findmnt >/dev/null; then
        findmnt -rn -o TARGET | grep -F "$rootfs" | sort -r | while read -r m; do
            umount -l "$m" || true
        done
    fi
    rm -rf "$work" "$tarball.tmp"
}
trap cleanup EXIT

start=$(date +%s)
echo "build-test-rootfs: debootstrap $suite from $mirror into $rootfs"
debootstrap --variant=minbase --include="$packages" "$suite" "$rootfs" "$mirror"
boot_done=$(date +%s)
# no service starts inside the chroot while packages install (policy-rc.d: 101 = refused)
printf '#!/bin/sh\nexit 101\n' >"$rootfs/usr/sbin/policy-rc.d"
chmod 0755 "$rootfs/usr/sbin/policy-rc.d"
chroot "$rootfs" apt-get update -qq
# shellcheck disable=SC2086
DEBIAN_FRONTEND=noninteractive chroot "$rootfs" apt-get install -y -qq --no-install-recommends $late_packages
rm -f "$rootfs/usr/sbin/policy-rc.d"

rm -f "$rootfs/etc/hostname"
: >"$rootfs/etc/machine-id"
rm -f "$rootfs"/etc/ssh/ssh_host_*

cat >"$rootfs/etc/ssh/sshd_config.d/voltaforge-test.conf" <<'EOF'
# voltaforge test image: key-only logins, one host key (written per boot by the fixture).
HostKey /etc/ssh/ssh_host_ed25519_key
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
EOF

chroot "$rootfs" useradd -m -s /bin/bash deploy
# '*' rather than the default '!': no password can match, and the account is not "locked"
# for sshd configurations that check it.
chroot "$rootfs" usermod -p '*' deploy
chroot "$rootfs" passwd -l root >/dev/null
install -d -m 700 "$rootfs/root/.ssh"
chroot "$rootfs" install -d -m 700 -o deploy -g deploy /home/deploy/.ssh

printf 'deploy ALL=(ALL:ALL) NOPASSWD: ALL\n' >"$rootfs/etc/sudoers.d/deploy"
chmod 0440 "$rootfs/etc/sudoers.d/deploy"
chroot "$rootfs" visudo -cf /etc/sudoers.d/deploy >/dev/null

# sshd must start at boot (debootstrap's postinst normally enables it already).
if [ ! -e "$rootfs/etc/systemd/system/multi-user.target.wants/ssh.service" ]; then
    ln -s /lib/systemd/system/ssh.service "$rootfs/etc/systemd/system/multi-user.target.wants/ssh.service"
fi

# Smaller tarball: package lists and .debs are not needed offline.
chroot "$rootfs" apt-get clean
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/log/*.log

tar --numeric-owner --xattrs --xattrs-include='*' -C "$rootfs" -cf - . \
    | zstd -q -T0 -10 -o "$tarball.tmp"
mv "$tarball.tmp" "$tarball"
end=$(date +%s)
echo "build-test-rootfs: wrote $tarball ($(du -h "$tarball" | cut -f1)); debootstrap $((boot_done - start)) s, total $((end - start)) s"
