"""CUDA toolchain facts: which nvcc/ptxas a host has, what they can build, what a binary holds.

Why (V100): Volta is sm_70, and only CUDA 9.0-12.x can compile for it; CUDA 13 refuses.
Hosts often carry two toolkits (e.g. NVIDIA's CUDA 13 in /usr/local and Debian's 11.8 in
/usr/bin), and nvcc finds ptxas through PATH, so an 11.8 nvcc can still die in a 13.x ptxas
('ptxas fatal : Value 'sm_70' is not defined for option 'gpu-name''). These facts list every
toolkit with its release, recognise those errors, and read `cuobjdump` listings to check
that a built library really contains sm_70 cubins. CUDA 11.8 also refuses GCC > 11 as host
compiler, hence the gcc fact.

Each fact: a read-only POSIX sh command (*_COMMAND, always exit 0) + a pure parser.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from shlex import quote
from typing import Literal

from pydantic import BaseModel, ConfigDict

from playbooks.facts import lines

# What the commands print instead of failing when the program is missing.
_ABSENT = re.compile(r"^voltaforge: (\S+) not found$", re.MULTILINE)


def _absent(program: str) -> str:
    return f"voltaforge: {program} not found"


# --------------------------------------------------------------------------- nvcc --version


class CudaToolVersion(BaseModel):
    """`<tool> --version` of a CUDA tool (nvcc, ptxas, cuobjdump): they share one format."""

    model_config = ConfigDict(frozen=True)

    available: bool
    reason: str = ""
    tool: str | None = None  # 'nvcc', 'ptxas', 'cuobjdump' (from the first banner line)
    release: tuple[int, int] | None = None  # 'release 11.8' -> (11, 8)
    version: str | None = None  # 'V11.8.89'
    version_tuple: tuple[int, ...] | None = None  # (11, 8, 89)
    build: str | None = None  # 'cuda_11.8.r11.8/compiler.31833905_0'
    built_on: str | None = None  # 'Wed_Sep_21_10:33:58_PDT_2022'

    @property
    def sm70_supported(self) -> bool:
        return self.release is not None and sm70_supported(self.release)


_BANNER = re.compile(r"^(?P<tool>[\w.+-]+): NVIDIA \(R\)")
_RELEASE = re.compile(r"release (?P<major>\d+)\.(?P<minor>\d+), V(?P<version>\d+(?:\.\d+)+)")
_BUILD = re.compile(r"^Build (\S+)")
_BUILT_ON = re.compile(r"^Built on (\S+)")


def parse_nvcc_version(text: str) -> CudaToolVersion:
    """Parse `nvcc --version` (also ptxas/cuobjdump --version). Stray lines such as a shell
    prompt are ignored; output without a 'release X.Y, VX.Y.Z' line is available=False."""
    stripped = (text or "").strip()
    if not stripped:
        return CudaToolVersion(available=False, reason="no output")
    if m := _ABSENT.search(stripped):
        return CudaToolVersion(available=False, reason=f"{m.group(1)} not found")
    tool = build = built_on = None
    release = version = None
    for line in lines(stripped):
        line = line.strip()
        if tool is None and (m := _BANNER.search(line)):
            tool = m.group("tool")
        if release is None and (m := _RELEASE.search(line)):
            release = (int(m.group("major")), int(m.group("minor")))
            version = m.group("version")
        if build is None and (m := _BUILD.match(line)):
            build = m.group(1)
        if built_on is None and (m := _BUILT_ON.match(line)):
            built_on = m.group(1)
    if release is None or version is None:
        first = next(ln.strip() for ln in lines(stripped) if ln.strip())
        return CudaToolVersion(available=False, tool=tool, reason=f"no 'release X.Y' line in version output: {first}")
    return CudaToolVersion(
        available=True,
        tool=tool,
        release=release,
        version=f"V{version}",
        version_tuple=tuple(int(p) for p in version.split(".")),
        build=build,
        built_on=built_on,
    )


def nvcc_version_command(nvcc: str = "nvcc") -> str:
    """`<nvcc> --version`, printing 'voltaforge: <nvcc> not found' instead of failing when there is none."""
    q = quote(nvcc)
    return f"if command -v {q} >/dev/null 2>&1; then {q} --version 2>&1 || true; else echo {quote(_absent(nvcc))}; fi"


NVCC_VERSION_COMMAND = nvcc_version_command("nvcc")


def sm70_supported(release: tuple[int, int] | None) -> bool:
    """Can a CUDA toolkit of this release compile sm_70 (V100) code?

    sm_70 arrived with Volta in CUDA 9.0, so anything older cannot target it. CUDA 12.x
    still compiles it (12.8/12.9 warn that pre-Turing targets are deprecated), and CUDA 13.0
    removed offline compilation for sm_50-sm_72: `nvcc fatal : Unsupported gpu architecture
    'compute_70'`. Hence 9.0 <= release < 13.0. (The driver side is separate: R580 is the
    last branch that runs Volta, and it still runs CUDA 11.8/12.x binaries.)
    """
    if release is None:
        return False
    return (9, 0) <= tuple(release) < (13, 0)


# --------------------------------------------------------------------------- all toolkits

TOOLKIT_MARKER = "### voltaforge-tool"
TOOLKIT_END = "### voltaforge-tool-end"
STANDARD_TOOLKIT_DIRS: tuple[str, ...] = (
    "/usr/local/cuda*/bin",
    "/opt/cuda/bin",
    "/usr/lib/nvidia-cuda-toolkit/bin",
    "/usr/bin",
)

# Lists every nvcc and ptxas on PATH (in PATH order: on_path_index 0 is the one a bare
# `nvcc` runs) and then in the standard places (on_path_index '-'), each once, with its
# resolved path and `--version` output between marker lines. POSIX sh: no `type -a`/`which
# -a` (not in dash/busybox); PATH is split with IFS=: and globbing off.
TOOLKITS_COMMAND = (
    r"""vf_seen='
'
vf_emit() {
  case "$vf_seen" in *"
$2
"*) return 1 ;; esac
  vf_seen="$vf_seen$2
"
  echo "### voltaforge-tool kind=$1 on_path_index=$3 path=$2"
  echo "### realpath=$(readlink -f "$2" 2>/dev/null)"
  "$2" --version </dev/null 2>&1
  echo "### voltaforge-tool-end"
  return 0
}
for vf_kind in nvcc ptxas; do
  vf_i=0
  vf_ifs=$IFS; IFS=:; set -f
  for vf_dir in $PATH; do
    [ -n "$vf_dir" ] || vf_dir=.
    if [ -f "$vf_dir/$vf_kind" ] && [ -x "$vf_dir/$vf_kind" ]; then
      vf_emit "$vf_kind" "$vf_dir/$vf_kind" "$vf_i" && vf_i=$((vf_i + 1))
    fi
  done
  IFS=$vf_ifs; set +f
  for vf_dir in """
    + " ".join(STANDARD_TOOLKIT_DIRS)
    + r"""; do
    if [ -f "$vf_dir/$vf_kind" ] && [ -x "$vf_dir/$vf_kind" ]; then
      vf_emit "$vf_kind" "$vf_dir/$vf_kind" - || :
    fi
  done
done
:"""
)


class Toolkit(BaseModel):
    """One nvcc or ptxas found on the host."""

    model_config = ConfigDict(frozen=True)

    path: str
    kind: Literal["nvcc", "ptxas"]
    release: tuple[int, int] | None = None
    version: str | None = None  # 'V13.0.88'
    # Position among this kind's matches in PATH order (0 = what a bare `nvcc` runs);
    # None = found only in a standard place, not on PATH.
    on_path_index: int | None = None
    realpath: str | None = None
    error: str | None = None  # why the version could not be read

    @property
    def sm70_supported(self) -> bool:
        return sm70_supported(self.release)


_TOOL_HEADER = re.compile(
    r"^### voltaforge-tool kind=(?P<kind>nvcc|ptxas) on_path_index=(?P<idx>\d+|-) path=(?P<path>.+)$"
)


def parse_toolkits(text: str) -> list[Toolkit]:
    """Parse TOOLKITS_COMMAND output into Toolkit entries, in output order (PATH ones first).

    An empty list means no nvcc/ptxas anywhere. A tool whose --version is unreadable is kept
    with release None and `error` set (a broken wrapper is still worth reporting)."""
    result: list[Toolkit] = []
    current: dict | None = None
    body: list[str] = []

    def finish() -> None:
        if current is None:
            return
        parsed = parse_nvcc_version("\n".join(body))
        result.append(
            Toolkit(
                release=parsed.release,
                version=parsed.version,
                error=None if parsed.available else parsed.reason,
                **current,
            )
        )

    for line in lines(text):
        if m := _TOOL_HEADER.match(line):
            finish()
            idx = m.group("idx")
            current = {
                "kind": m.group("kind"),
                "path": m.group("path"),
                "on_path_index": None if idx == "-" else int(idx),
            }
            body = []
        elif current is not None and line.startswith("### realpath="):
            current["realpath"] = line[len("### realpath=") :] or None
        elif line.strip() == TOOLKIT_END:
            finish()
            current = None
        elif current is not None:
            body.append(line)
    finish()  # output cut off before the end marker
    return result


def first_on_path(toolkits: Sequence[Toolkit], kind: str) -> Toolkit | None:
    """The nvcc/ptxas a bare command name runs (on_path_index 0), if any."""
    return next((t for t in toolkits if t.kind == kind and t.on_path_index == 0), None)


def mixed_toolkits_warning(toolkits: Sequence[Toolkit]) -> str | None:
    """A message when more than one CUDA release is installed.

    nvcc runs ptxas from its own directory when that holds one (NVIDIA layout) and otherwise
    from PATH (Debian's /usr/bin/nvcc does), so with two releases a build must pin PATH,
    CUDA_HOME and CUDACXX to one toolkit."""
    releases = sorted({t.release for t in toolkits if t.release is not None})
    if len(releases) < 2:
        return None
    names = ", ".join(f"{a}.{b}" for a, b in releases)
    ptxas = first_on_path(toolkits, "ptxas")
    where = (
        f"; the ptxas first on PATH is {ptxas.path} (CUDA {ptxas.release[0]}.{ptxas.release[1]})"
        if ptxas is not None and ptxas.release
        else ""
    )
    return (
        f"several CUDA releases installed ({names}){where}: set PATH, CUDA_HOME and CUDACXX "
        f"to one toolkit before building"
    )


# --------------------------------------------------------------------------- cuobjdump

_ELF_ENTRY = re.compile(r"^ELF file\s+\d+:\s+\S*?\.(?P<arch>sm_\d+[a-z]?)\.cubin\s*$")
_PTX_ENTRY = re.compile(r"^PTX file\s+\d+:\s+\S*?\.(?P<arch>(?:sm|compute)_\d+[a-z]?)\.ptx\s*$")


def _archs(text: str, pattern: re.Pattern[str]) -> Counter[str]:
    return Counter(m.group("arch") for line in lines(text) if (m := pattern.match(line.strip())))


def parse_cuobjdump_list_elf(text: str) -> set[str]:
    """`cuobjdump --list-elf <lib>` -> the real-GPU archs it holds, e.g. {'sm_70'}.

    A V100 needs 'sm_70' here (or PTX of compute <= 70 to JIT, which is slow at first start)."""
    return set(_archs(text, _ELF_ENTRY))


def parse_cuobjdump_list_ptx(text: str) -> set[str]:
    """`cuobjdump --list-ptx <lib>` -> the PTX archs it holds (named 'sm_XX' in file names)."""
    return set(_archs(text, _PTX_ENTRY))


# --------------------------------------------------------------------------- nvcc errors


class NvccError(BaseModel):
    """One recognised toolchain failure line."""

    model_config = ConfigDict(frozen=True)

    kind: Literal["unsupported_gpu_architecture", "ptxas_arch_not_defined", "unsupported_host_compiler"]
    tool: str  # 'nvcc', 'ptxas', or the host compiler's header ('crt/host_config.h')
    arch: str | None = None  # 'compute_70', 'sm_70'
    line: str
    hint: str

    @property
    def is_volta(self) -> bool:
        return self.arch is not None and self.arch.endswith("_70")


_ERR_UNSUPPORTED_ARCH = re.compile(r"nvcc fatal\s*:\s*Unsupported gpu architecture '(?P<arch>[^']+)'")
_ERR_PTXAS_ARCH = re.compile(r"ptxas fatal\s*:\s*Value '(?P<arch>[^']+)' is not defined for option 'gpu-name'")
_ERR_HOST_GCC = re.compile(r"#error -- unsupported GNU version!.*")


def parse_nvcc_error(text: str) -> list[NvccError]:
    """Find the toolchain errors that matter for sm_70 in build output (one per line; a line
    repeated by make or by gcc's caret excerpt is reported once)."""
    errors: list[NvccError] = []
    seen: set[tuple[str, str | None, str]] = set()
    for raw in lines(text):
        line = raw.strip()
        if m := _ERR_UNSUPPORTED_ARCH.search(line):
            err = NvccError(
                kind="unsupported_gpu_architecture",
                tool="nvcc",
                arch=m.group("arch"),
                line=line,
                hint="this nvcc cannot target that GPU: sm_70 needs CUDA 9.0-12.x, not 13+",
            )
        elif m := _ERR_PTXAS_ARCH.search(line):
            err = NvccError(
                kind="ptxas_arch_not_defined",
                tool="ptxas",
                arch=m.group("arch"),
                line=line,
                hint="nvcc ran a ptxas from another (newer) CUDA release found on PATH: "
                "put the toolkit's own bin directory first on PATH",
            )
        elif _ERR_HOST_GCC.search(line):
            if "host_config.h" not in line:
                continue  # gcc's caret excerpt repeats the #error text without the file name
            err = NvccError(
                kind="unsupported_host_compiler",
                tool="crt/host_config.h",
                line=line,
                hint="host GCC too new for this CUDA release: use an older g++ via -ccbin (CUDA 11.8: g++-11)",
            )
        else:
            continue
        key = (err.kind, err.arch, err.line)
        if key not in seen:
            seen.add(key)
            errors.append(err)
    return errors


# --------------------------------------------------------------------------- gcc


class GccVersion(BaseModel):
    """`gcc --version` / `g++-11 --version` / `gcc -dumpfullversion`."""

    model_config = ConfigDict(frozen=True)

    available: bool
    reason: str = ""
    program: str | None = None  # 'gcc', 'g++-11' (None for -dumpfullversion output)
    package_version: str | None = None  # 'Debian 12.2.0-14+deb12u1'
    version: tuple[int, ...] | None = None  # (12, 2, 0)

    @property
    def major(self) -> int | None:
        return self.version[0] if self.version else None


_GCC_BANNER = re.compile(r"^(?P<prog>\S*(?:gcc|g\+\+|cc|c\+\+)\S*) (?:\((?P<pkg>[^)]*)\) )?(?P<ver>\d+(?:\.\d+)*)")
_BARE_VERSION = re.compile(r"^\d+(?:\.\d+)*$")


def parse_gcc_version(text: str) -> GccVersion:
    """Parse the first line of `gcc --version` ('gcc (Debian 12.2.0-14+deb12u1) 12.2.0') or
    the bare number from `gcc -dumpfullversion`/`-dumpversion` ('12.2.0' / '12')."""
    stripped = (text or "").strip()
    if not stripped:
        return GccVersion(available=False, reason="no output")
    if m := _ABSENT.search(stripped):
        return GccVersion(available=False, reason=f"{m.group(1)} not found")
    for line in lines(stripped):
        line = line.strip()
        if _BARE_VERSION.match(line):
            return GccVersion(available=True, version=tuple(int(p) for p in line.split(".")))
        if m := _GCC_BANNER.match(line):
            return GccVersion(
                available=True,
                program=m.group("prog"),
                package_version=m.group("pkg"),
                version=tuple(int(p) for p in m.group("ver").split(".")),
            )
    return GccVersion(available=False, reason=f"unrecognised gcc output: {lines(stripped)[0]}")


def gcc_version_command(compiler: str = "gcc") -> str:
    """`<compiler> --version` (first line only), printing 'voltaforge: <compiler> not found' when there is none."""
    q = quote(compiler)
    return (
        f"if command -v {q} >/dev/null 2>&1; then {q} --version 2>&1 | head -n 1; "
        f"else echo {quote(_absent(compiler))}; fi"
    )


GCC_VERSION_COMMAND = gcc_version_command("gcc")
GXX11_VERSION_COMMAND = gcc_version_command("g++-11")
