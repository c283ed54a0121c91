"""Build-time benchmark (issue: invoke build, item 8): prints figures, asserts nothing.

What it measures, on this machine, through `invoke build`'s own commands (EnsureLlamacppBuild's
plan: the same environment and flags):

1. A representative part of ggml-cuda (a few kernels, by default softmax, rope, getrows, argmax)
   compiled for sm_70 only (voltaforge's flags) and for llama.cpp's default arch list
   (GGML_NATIVE=OFF, CUDA 11.8: 50/61/70/75/80-virtual, 86/89-real, 90-virtual), each cold (empty
   ccache) and again with a warm ccache; and what each object holds (cuobjdump: sm_70 cubins
   or only compute_70 PTX, the seed's first pitfall).
2. With --cpu: the whole CPU build (the tiny-cpu recipe's targets), cold and with a warm ccache.

Usage: .venv/bin/python scripts/bench_build.py [--cpu] [--objects softmax,rope] [--work DIR]
With --cpu and the default objects it writes reports/local/bench-build.json (the printed table
as extra.output). A whole sm_70 ggml-cuda build is ~50 minutes on 2 cores (docs/knowledge.md
section 3): not here.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from playbooks.facts import cuda
from playbooks.host import LocalHost
from playbooks.steps.build.build import BuildLayout, EnsureLlamacppBuild
from playbooks.steps.build.buildenv import env_prefix, require_cmake
from playbooks.steps.build.llamacpp_source import fetch_sdist

ROOT = Path(__file__).resolve().parent.parent
#: what the file measures (results.py): the build step's environment and flags
MEASURES = ["playbooks/steps/build/build.py", "playbooks/steps/build/buildenv.py", "scripts/bench_build.py"]
DEFAULT_OBJECTS = "softmax,rope,getrows,argmax"


class Failed(Exception):
    """A compile that failed: the first compiler error line says why."""


def sh(cmd: str, cwd: Path | None = None) -> float:
    t0 = time.monotonic()
    r = subprocess.run(["bash", "-c", cmd], cwd=cwd, capture_output=True, text=True)
    if r.returncode != 0:
        errors = [line.strip() for line in (r.stdout + r.stderr).splitlines() if "error" in line]
        raise Failed(errors[0] if errors else f"exit {r.returncode}: {cmd[:120]}")
    return time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true", help="also time the whole CPU build (about 10 minutes)")
    ap.add_argument("--objects", default=DEFAULT_OBJECTS)
    ap.add_argument("--work", default=None)
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="vf-bench-build-"))
    source = fetch_sdist("llama-cpp-python==0.3.36", "0c1e570")
    layout = BuildLayout(str(work / "vf"))
    tree = Path(layout.tree(source))
    if not (tree / "CMakeLists.txt").exists():
        tree.mkdir(parents=True, exist_ok=True)
        strip = source.member.count("/") + 1
        sh(f"tar -xzf {shlex.quote(str(source.archive))} -C {tree} --strip-components={strip} {source.member}")
    host = LocalHost()
    objects = [f"{name}.cu.o" for name in args.objects.split(",")]
    rows: list[tuple[str, float | None, float | None, str, str]] = []

    # the build step's own environment, cmake and flags (EnsureLlamacppBuild.plan), not a
    # parse of the command it shows
    op = EnsureLlamacppBuild(layout, source, cuda_release=(11, 8), recipe_arch="70")
    facts = op.read(host)
    inputs, env, _ = op.plan(facts)
    cmake = require_cmake(facts)
    # llama.cpp's default list (GGML_NATIVE=OFF, CUDA 11.8) and the same without its 90-virtual
    # entry, which at this ref uses Hopper launch intrinsics CUDA 11.8's headers do not declare
    without_90 = "50-virtual;61-virtual;70-virtual;75-virtual;80-virtual;86-real;89-real"
    configs = (
        ("sm_70 only (voltaforge)", "sm70", "70"),
        ("llama.cpp default list", "default", None),
        ("default list without 90", "default-no90", without_90),
    )
    for label, dirname, arch in configs:
        build = work / dirname
        ccache = work / f"ccache-{build.name}"
        shutil.rmtree(build, ignore_errors=True)
        shutil.rmtree(ccache, ignore_errors=True)
        flags = [f for f in inputs.flags if not f.startswith("-DCMAKE_CUDA_ARCHITECTURES=")]
        run_env = {k: v for k, v in env.items() if k != "CUDAARCHS"} | {"CCACHE_DIR": str(ccache)}
        if arch:
            flags.append(f"-DCMAKE_CUDA_ARCHITECTURES={arch}")
        sh(f"{env_prefix(run_env)} {cmake} -DLLAMA_BUILD_SERVER=OFF -S {tree} -B {build} {shlex.join(flags)}")
        cuda_dir = build / "ggml/src/ggml-cuda"
        make = f"{env_prefix(run_env)} make -C {cuda_dir} {' '.join(objects)}"
        try:
            cold = sh(make)
        except Failed as exc:
            rows.append((label, None, None, "-", f"does not compile: {exc}"))
            continue
        listing = subprocess.run(
            [
                "bash",
                "-c",
                f"/usr/bin/cuobjdump --list-elf --list-ptx {cuda_dir}/CMakeFiles/ggml-cuda.dir/softmax.cu.o",
            ],
            capture_output=True,
            text=True,
        ).stdout
        elf = sorted(cuda.parse_cuobjdump_list_elf(listing))
        ptx = sorted(cuda.parse_cuobjdump_list_ptx(listing))
        for o in objects:
            (cuda_dir / "CMakeFiles/ggml-cuda.dir" / o).unlink()
        warm = sh(make)
        rows.append((label, cold, warm, ", ".join(elf) or "none", ", ".join(ptx) or "none"))

    table = [f"ggml-cuda objects: {', '.join(objects)} (CUDA 11.8, {subprocess.getoutput('nproc')} cores)"]
    table.append(f"{'arch':26} {'cold s':>8} {'warm ccache s':>14}  cubins (softmax)      PTX (softmax)")
    for label, c, w, elf_s, ptx_s in rows:
        if c is None or w is None:
            table.append(f"{label:26} {'-':>8} {'-':>14}  {ptx_s}")
        else:
            table.append(f"{label:26} {c:8.1f} {w:14.1f}  {elf_s:20}  {ptx_s}")
    for label, c, _, _, _ in rows[1:]:
        if rows[0][1] and c:
            table.append(f"{label} vs sm_70 only, cold: {c / rows[0][1]:.1f}x the time")
    print("\n".join(table), flush=True)

    if args.cpu:
        cpu = EnsureLlamacppBuild(layout, source, cuda_release=None, recipe_arch="none")
        cpu_facts = cpu.read(host)
        cpu_inputs, cpu_env, _ = cpu.plan(cpu_facts)
        ccache = work / "ccache-cpu"
        shutil.rmtree(ccache, ignore_errors=True)
        run_env = cpu_env | {"CCACHE_DIR": str(ccache)}
        jobs = cpu_facts.nproc or 2
        times = []
        for n in (1, 2):
            target = work / f"cpu{n}"
            shutil.rmtree(target, ignore_errors=True)
            sh(f"{env_prefix(run_env)} {cmake} -S {tree} -B {target} {shlex.join(cpu_inputs.flags)}")
            targets = shlex.join(cpu_inputs.targets)
            times.append(
                sh(f"{env_prefix(run_env)} {cmake} --build {target} --config Release -j {jobs} --target {targets}")
            )
        print(
            f"CPU build (tiny-cpu targets): cold {times[0]:.0f} s, "
            f"warm ccache {times[1]:.0f} s ({times[0] / times[1]:.1f}x)"
        )
        by = {label: (c, w) for label, c, w, _, _ in rows}
        sm70, no90 = by["sm_70 only (voltaforge)"], by["default list without 90"]
        if args.objects == DEFAULT_OBJECTS and None not in (*sm70, *no90):
            write(table, sm70, no90, times)


def write(table: list[str], sm70: tuple, no90: tuple, cpu: list[float]) -> None:
    from playbooks.results import write_result

    write_result(
        ROOT / "reports" / "local" / "bench-build.json",
        "scripts/bench_build.py: four ggml-cuda objects for sm_70 only and for llama.cpp's default list "
        "(CUDA 11.8), cold and with a warm ccache; the whole CPU build cold and warm",
        {
            "sm70_cold_s": round(sm70[0], 1),
            "sm70_warm_ccache_s": round(sm70[1], 1),
            "default_no90_cold_s": round(no90[0], 1),
            "default_no90_warm_ccache_s": round(no90[1], 1),
            "default_no90_over_sm70_x": round(no90[0] / sm70[0], 1),
            "cpu_cold_s": round(cpu[0]),
            "cpu_warm_ccache_s": round(cpu[1]),
            "cpu_cold_over_warm_x": round(cpu[0] / cpu[1], 1),
        },
        {
            "sm70_cold_s": "s",
            "sm70_warm_ccache_s": "s",
            "default_no90_cold_s": "s",
            "default_no90_warm_ccache_s": "s",
            "default_no90_over_sm70_x": "x",
            "cpu_cold_s": "s",
            "cpu_warm_ccache_s": "s",
            "cpu_cold_over_warm_x": "x",
        },
        ".venv/bin/python scripts/bench_build.py --cpu",
        notes="extra.output is the ggml-cuda table as printed; the CPU figures are the line after it.",
        extra={"output": "\n".join(table)},
        measures=MEASURES,
    )


if __name__ == "__main__":
    main()
