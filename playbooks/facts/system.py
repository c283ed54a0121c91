"""Host system facts: distribution, disk space, memory, python3, systemd, CPUs, machine arch.

Why (V100 serving): the distribution decides where CUDA 11.8 comes from (Debian 12's
`nvidia-cuda-toolkit` vs NVIDIA's repo on Ubuntu); a 27B model needs tens of GB free where
weights and the llama.cpp build go (often a path that does not exist yet, so the disk fact
walks up to the nearest existing parent); RAM decides whether a CPU-offloaded fallback is even
possible; the GPU probe needs python3; the serving unit needs a running systemd (containers
and this build box have none); nproc sizes `cmake --build -j`.

Each fact: a read-only POSIX sh command (*_COMMAND or a *_command() builder, exit 0 always)
plus a pure parser that returns an explicit "absent" value instead of raising.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from shlex import quote

from pydantic import BaseModel, ConfigDict

from playbooks.facts import lines

_ABSENT = re.compile(r"^voltaforge: (.+) not found$", re.MULTILINE)


# --------------------------------------------------------------------------- os-release

OS_RELEASE_COMMAND = (
    "cat /etc/os-release 2>/dev/null || cat /usr/lib/os-release 2>/dev/null || echo 'voltaforge: os-release not found'"
)


class OsRelease(BaseModel):
    model_config = ConfigDict(frozen=True)

    available: bool
    reason: str = ""
    id: str | None = None  # 'debian', 'ubuntu'
    id_like: tuple[str, ...] = ()
    version_id: str | None = None  # '12', '22.04'
    codename: str | None = None  # 'bookworm'
    pretty_name: str | None = None


def _unquote(value: str) -> str:
    """os-release values are shell-quoted: strip one level of quotes and escapes."""
    value = value.strip()
    if len(value) >= 2 and value[0] == value[-1] == "'":
        return value[1:-1]
    if len(value) >= 2 and value[0] == value[-1] == '"':
        return re.sub(r'\\([\\"$`])', r"\1", value[1:-1])
    return value


def parse_os_release(text: str) -> OsRelease:
    """Parse /etc/os-release (KEY=value lines, values optionally quoted)."""
    if _ABSENT.search(text or ""):
        return OsRelease(available=False, reason="os-release not found")
    values: dict[str, str] = {}
    for line in lines(text):
        m = re.match(r"^([A-Z][A-Z0-9_]*)=(.*)$", line.strip())
        if m:
            values[m.group(1)] = _unquote(m.group(2))
    if "ID" not in values:
        return OsRelease(available=False, reason="no ID= line in os-release output")
    codename = values.get("VERSION_CODENAME") or values.get("UBUNTU_CODENAME")
    if not codename:  # old files: VERSION="9 (stretch)"
        m = re.search(r"\(([a-z]+)\)", values.get("VERSION", ""))
        codename = m.group(1) if m else None
    return OsRelease(
        available=True,
        id=values["ID"].lower(),
        id_like=tuple(values.get("ID_LIKE", "").split()),
        version_id=values.get("VERSION_ID"),
        codename=codename,
        pretty_name=values.get("PRETTY_NAME"),
    )


# --------------------------------------------------------------------------- disk space

DF_PATH_MARKER = "### voltaforge-df path="
DF_EXISTING_MARKER = "### voltaforge-df existing="


def disk_free_command(paths: Sequence[str]) -> str:
    """`df -P -B1` for each path, or for its nearest existing parent when it does not exist
    yet (a model dir that a later step creates): each answer is preceded by two marker lines
    naming the asked path and the path df was run on."""
    quoted = " ".join(quote(p) for p in paths)
    return (
        f"for vf_p in {quoted}; do "
        "vf_q=$vf_p; "
        'while [ ! -e "$vf_q" ] && [ "$vf_q" != / ] && [ "$vf_q" != . ]; do '
        'vf_q=$(dirname -- "$vf_q"); done; '
        f'echo "{DF_PATH_MARKER}$vf_p"; echo "{DF_EXISTING_MARKER}$vf_q"; '
        'df -P -B1 -- "$vf_q" 2>&1 || :; '
        "done"
    )


class DiskFree(BaseModel):
    model_config = ConfigDict(frozen=True)

    path: str  # the path asked about
    existing_path: str  # the path df was run on (path itself, or its nearest existing parent)
    filesystem: str | None = None
    size_bytes: int | None = None
    used_bytes: int | None = None
    available_bytes: int | None = None  # what an unprivileged user can still write
    mount_point: str | None = None
    error: str | None = None

    @property
    def exists(self) -> bool:
        return self.path == self.existing_path


_DF_ROW = re.compile(
    r"^(?P<fs>.+?)\s+(?P<size>\d+)\s+(?P<used>\d+)\s+(?P<avail>\d+)\s+(?P<cap>\d+%|-)\s+(?P<mount>/.*)$"
)


def parse_df(text: str) -> dict[str, DiskFree]:
    """Parse disk_free_command() output (or plain `df -P -B1` output, keyed by mount point)
    into {asked path: DiskFree}."""
    result: dict[str, DiskFree] = {}
    path: str | None = None
    existing: str | None = None
    errors: list[str] = []

    def close() -> None:
        if path is not None and path not in result:
            result[path] = DiskFree(
                path=path, existing_path=existing or path, error="; ".join(errors) or "no df output"
            )

    for line in lines(text):
        if line.startswith(DF_PATH_MARKER):
            close()
            path, existing, errors = line[len(DF_PATH_MARKER) :], None, []
            continue
        if line.startswith(DF_EXISTING_MARKER):
            existing = line[len(DF_EXISTING_MARKER) :]
            continue
        m = _DF_ROW.match(line.strip())
        if m:
            key = path if path is not None else m.group("mount")
            result[key] = DiskFree(
                path=key,
                existing_path=existing or key,
                filesystem=m.group("fs"),
                size_bytes=int(m.group("size")),
                used_bytes=int(m.group("used")),
                available_bytes=int(m.group("avail")),
                mount_point=m.group("mount"),
            )
        elif line.strip() and not line.startswith("Filesystem"):
            errors.append(line.strip())
    close()
    return result


# --------------------------------------------------------------------------- memory

MEMINFO_COMMAND = "cat /proc/meminfo 2>/dev/null || echo 'voltaforge: /proc/meminfo not found'"


class MemInfo(BaseModel):
    model_config = ConfigDict(frozen=True)

    available: bool
    reason: str = ""
    mem_total_bytes: int | None = None
    # Kernel's estimate of memory usable without swapping (absent before Linux 3.14).
    mem_available_bytes: int | None = None
    swap_total_bytes: int | None = None
    swap_free_bytes: int | None = None


def parse_meminfo(text: str) -> MemInfo:
    """Parse /proc/meminfo ('MemTotal:  8123456 kB'; the kernel's kB are KiB)."""
    values: dict[str, int] = {}
    for line in lines(text):
        m = re.match(r"^(\w+(?:\(\w+\))?):\s+(\d+)(?:\s+(kB))?\s*$", line.strip())
        if m:
            values[m.group(1)] = int(m.group(2)) * (1024 if m.group(3) else 1)
    if "MemTotal" not in values:
        return MemInfo(available=False, reason="no MemTotal in /proc/meminfo output")
    return MemInfo(
        available=True,
        mem_total_bytes=values["MemTotal"],
        mem_available_bytes=values.get("MemAvailable"),
        swap_total_bytes=values.get("SwapTotal"),
        swap_free_bytes=values.get("SwapFree"),
    )


# --------------------------------------------------------------------------- python3

PYTHON_VERSION_COMMAND = (
    "if command -v python3 >/dev/null 2>&1; then "
    'echo "path=$(command -v python3)"; python3 --version 2>&1 || :; '
    "else echo 'voltaforge: python3 not found'; fi"
)


class PythonVersion(BaseModel):
    model_config = ConfigDict(frozen=True)

    available: bool
    reason: str = ""
    path: str | None = None
    version: tuple[int, ...] | None = None  # (3, 11, 2)


def parse_python_version(text: str) -> PythonVersion:
    """Parse PYTHON_VERSION_COMMAND output (or a bare 'Python 3.11.2' line)."""
    if _ABSENT.search(text or ""):
        return PythonVersion(available=False, reason="python3 not found")
    path = version = None
    for line in lines(text):
        line = line.strip()
        if line.startswith("path="):
            path = line[len("path=") :] or None
        elif m := re.match(r"^Python (\d+(?:\.\d+)*)", line):
            version = tuple(int(p) for p in m.group(1).split("."))
    if version is None:
        return PythonVersion(available=False, path=path, reason="no 'Python X.Y.Z' line in output")
    return PythonVersion(available=True, path=path, version=version)


# --------------------------------------------------------------------------- systemd

# /run/systemd/system exists only when systemd is PID 1 (sd_booted()); is-system-running
# then says how healthy it is. Both, because systemctl may be installed in a container
# that was not booted with systemd (it then answers 'offline').
SYSTEMD_COMMAND = (
    "if [ -d /run/systemd/system ]; then echo booted=yes; else echo booted=no; fi; "
    "if command -v systemctl >/dev/null 2>&1; then "
    "echo \"state=$(systemctl is-system-running 2>&1 | tr '\\n' ' ')\"; "
    "else echo state=no-systemctl; fi"
)

# States in which units can be started and enabled ('degraded' = some unit failed).
SYSTEMD_USABLE_STATES = frozenset({"running", "degraded", "starting", "initializing"})


class SystemdState(BaseModel):
    model_config = ConfigDict(frozen=True)

    systemd_running: bool
    booted: bool  # /run/systemd/system present
    systemctl_present: bool
    state: str | None = None  # `systemctl is-system-running`: running, degraded, offline, ...


def parse_systemd(text: str) -> SystemdState:
    """Parse SYSTEMD_COMMAND output. systemd_running = booted with systemd and in a usable state."""
    booted = False
    state: str | None = None
    present = False
    for line in lines(text):
        line = line.strip()
        if line.startswith("booted="):
            booted = line == "booted=yes"
        elif line.startswith("state="):
            value = line[len("state=") :].strip()
            present = value != "no-systemctl"
            state = value if present and value else None
    return SystemdState(
        systemd_running=booted and state in SYSTEMD_USABLE_STATES,
        booted=booted,
        systemctl_present=present,
        state=state,
    )


# --------------------------------------------------------------------------- CPUs, arch

NPROC_COMMAND = "nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 'voltaforge: nproc not found'"
UNAME_MACHINE_COMMAND = "uname -m 2>/dev/null || echo 'voltaforge: uname not found'"


def parse_nproc(text: str) -> int | None:
    """CPUs available to this process (nproc honours affinity/cgroup cpusets); None if unknown."""
    for line in lines(text):
        if re.fullmatch(r"\d+", line.strip()) and int(line.strip()) > 0:
            return int(line.strip())
    return None


_ARCH_ALIASES = {"amd64": "x86_64", "arm64": "aarch64"}


def parse_uname_machine(text: str) -> str | None:
    """`uname -m` -> 'x86_64' / 'aarch64' (amd64/arm64 spellings normalised); None if unknown.

    V100 hosts are x86_64 or ppc64le (IBM AC922); CUDA wheels and packages differ per arch."""
    if _ABSENT.search(text or ""):
        return None
    for line in lines(text):
        line = line.strip()
        if re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", line):
            return _ARCH_ALIASES.get(line.lower(), line)
    return None


# --------------------------------------------------------------------------- last-level cache

# The caches the kernel reports for cpu0 (sysfs cacheinfo: the CPUs' own CPUID/ACPI tables, as
# the kernel read them, and what `lscpu -C` prints). Not `getconf LEVEL3_CACHE_SIZE`: glibc
# computes that itself, and on this machine (AMD EPYC, 2 vCPUs) it says 320 MiB where the
# kernel's topology and lscpu say 32 MiB: ten times the cache a model would be judged to fit.
LLC_COMMAND = (
    "vf_found=; for vf_d in /sys/devices/system/cpu/cpu0/cache/index*; do "
    'if [ -r "$vf_d/level" ] && [ -r "$vf_d/size" ]; then vf_found=1; '
    'echo "level=$(cat "$vf_d/level") type=$(cat "$vf_d/type" 2>/dev/null) size=$(cat "$vf_d/size")'
    ' shared=$(cat "$vf_d/shared_cpu_list" 2>/dev/null)"; fi; done; '
    "[ -n \"$vf_found\" ] || echo 'voltaforge: cpu cache sizes not found'"
)


class LastLevelCache(BaseModel):
    model_config = ConfigDict(frozen=True)

    available: bool
    reason: str = ""
    level: int | None = None  # 3 on most x86 servers; 2 on many Arm boards
    size_bytes: int | None = None  # one instance: what the CPUs of ``shared_cpus`` share
    shared_cpus: str | None = None  # '0-1', the kernel's shared_cpu_list


_CACHE_LINE = re.compile(r"^level=(\d+) type=(\S*) size=(\d+)([KMG]?)\s*(?:shared=(\S*))?\s*$")
_SIZE_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3}  # sysfs's "32768K" is KiB


def parse_llc(text: str) -> LastLevelCache:
    """Parse LLC_COMMAND output: the highest-level data or unified cache cpu0 has, one instance
    of it (a host with several, one per chiplet or socket, shares one only among its own CPUs:
    the size a thread can count on). Never raises: absent or garbled output is ``available=False``."""
    if _ABSENT.search(text or ""):
        return LastLevelCache(available=False, reason="the kernel reports no CPU caches (no sysfs cacheinfo)")
    found: list[tuple[int, int, str | None]] = []
    for line in lines(text):
        m = _CACHE_LINE.match(line.strip())
        if m and m.group(2) != "Instruction" and int(m.group(3)) > 0:
            found.append((int(m.group(1)), int(m.group(3)) * _SIZE_UNITS[m.group(4)], m.group(5) or None))
    if not found:
        return LastLevelCache(available=False, reason="no data or unified cache in the output")
    level, size, shared = max(found, key=lambda c: (c[0], c[1]))
    return LastLevelCache(available=True, level=level, size_bytes=size, shared_cpus=shared)
