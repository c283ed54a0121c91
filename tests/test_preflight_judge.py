"""preflight's judgement, on facts parsed from real captured outputs (V100 hosts and this
machine's real CUDA 13 + 11.8 pair). Gathering over real SSH is in test_preflight_hosts.py."""

import re

import pytest

from playbooks.config.recipe import load_recipe
from playbooks.facts import cuda, system
from playbooks.steps.preflight import HostFacts, judge
from tests.helpers import ROOT, fixture_body
from tests.nvidia_smi_text import parse_nvidia_smi_table

GIB = 1 << 30


def facts(gpu_fixture="nvidia-smi-v100-sxm2-16gb-aws-p3-driver525.txt", free_bytes=500 * 10**9, booted=True, **over):
    gpus = parse_nvidia_smi_table(fixture_body(gpu_fixture) if gpu_fixture else "")
    base = dict(
        host="v100-01",
        os=system.parse_os_release(fixture_body("thishost-os-release-debian12.txt")),
        gpus=gpus,
        toolkits=cuda.parse_toolkits(fixture_body("thishost-toolkits-cuda13-and-debian-cuda11.8.txt")),
        gcc=cuda.parse_gcc_version(fixture_body("thishost-gcc-12-version.txt")),
        gxx11=cuda.parse_gcc_version(fixture_body("thishost-gxx-11-version.txt")),
        python=system.parse_python_version(fixture_body("thishost-python3-version.txt")),
        disk={
            "/opt/voltaforge/models": system.DiskFree(
                path="/opt/voltaforge/models", existing_path="/opt", available_bytes=free_bytes
            )
        },
        memory=system.parse_meminfo(fixture_body("thishost-proc-meminfo.txt")),
        systemd=system.SystemdState(
            systemd_running=booted, booted=booted, systemctl_present=True, state="running" if booted else "offline"
        ),
        nproc=2,
        machine="x86_64",
    )
    base.update(over)
    return HostFacts(**base)


def by_name(v):
    return {c.name: c for c in v.checks}


def test_v100_host_ready_for_a_recipe_that_fits():
    v = judge(facts(), load_recipe("qwen2.5-14b-v100-16gb"), "/opt/voltaforge/models", "/opt/voltaforge")
    c = by_name(v)
    assert v.ok, [x for x in v.checks if x.status == "fail"]
    assert c["gpu"].status == "pass" and "Tesla V100-SXM2, 16384 MiB, cc 7.0" in c["gpu"].detail
    assert "Tesla V100-SXM2-16GB" in c["fit"].detail
    assert c["bf16"].status == "warn" and "FP16" in c["bf16"].fix
    assert c["cuda-toolkit"].status == "pass" and "/usr/bin/nvcc" in c["cuda-toolkit"].detail
    # this machine's real pair: CUDA 13 first on PATH, Debian's 11.8 in /usr/bin
    assert c["cuda-on-path"].status == "warn" and "cannot target sm_70" in c["cuda-on-path"].detail
    assert (
        c["mixed-toolkits"].status == "warn"
        and "13.0" in c["mixed-toolkits"].detail
        and "CUDACXX" in c["mixed-toolkits"].fix
    )
    assert c["host-compiler"].status == "pass"
    assert c["fit"].status == "pass" and "fits with" in c["fit"].detail


def test_recipe_that_does_not_fit_the_real_gpu_blocks():
    # a 32 GB recipe judged on the 16 GB card the host really has
    v = judge(facts(), load_recipe("qwen2.5-32b-v100-32gb"), "/opt/voltaforge/models", "/opt/voltaforge")
    fit = by_name(v)["fit"]
    assert not v.ok and fit.status == "fail" and fit.blocking
    assert "does not fit by" in fit.detail and "Tesla V100-SXM2-16GB" in fit.detail and fit.fix.startswith("choose ")


def test_old_driver_for_cuda_11_8():
    v = judge(
        facts("nvidia-smi-v100-sxm2-32gb-8gpu-dgx1-driver384.txt"),
        load_recipe("qwen2.5-32b-v100-32gb"),
        "/opt/voltaforge/models",
        "/opt/voltaforge",
    )
    drv = by_name(v)["driver"]
    assert drv.status == "fail" and "384.183" in drv.detail and "450.80.2" in drv.detail and not v.ok


def test_no_gpu_blocks_a_gpu_recipe_but_not_the_cpu_one():
    no_gpu = facts(gpu_fixture=None)
    v = judge(no_gpu, load_recipe("qwen2.5-14b-v100-16gb"), "/opt/voltaforge/models", "/opt/voltaforge")
    assert by_name(v)["gpu"].status == "fail" and not v.ok
    v = judge(no_gpu, load_recipe("tiny-cpu"), "/opt/voltaforge/models", "/opt/voltaforge")
    assert by_name(v)["gpu"].status == "pass" and "cuda-toolkit" not in by_name(v) and v.ok


def test_disk_too_small_for_download_plus_conversion():
    """Need = the BF16 download + the FP16 intermediate (2 bytes per parameter each) + the
    quantized file. By hand for Qwen2.5-14B-Instruct (its config.json: hidden 5120, 48 layers,
    8 KV heads of 128, FFN 13824, vocabulary 152064, untied, q/k/v biases): 14,770,033,664
    parameters (the model card says 14.7B); its Q4_K_M file as published by bartowski:
    8,988,110,976 B (tests/data/published_gguf_sizes.yaml). 4 x 14.77e9 + 8.99e9 = 68.07 GB."""
    per_layer = (5120 * 5120 + 5120) + 2 * (5120 * 1024 + 1024) + 5120 * 5120 + 3 * 5120 * 13824 + 2 * 5120
    params = 48 * per_layer + 2 * 152064 * 5120 + 5120
    assert params == 14_770_033_664
    need = 4 * params + 8_988_110_976
    v = judge(
        facts(free_bytes=40 * 10**9), load_recipe("qwen2.5-14b-v100-16gb"), "/opt/voltaforge/models", "/opt/voltaforge"
    )
    disk = by_name(v)["disk"]
    assert disk.status == "fail" and disk.blocking and not v.ok
    shown = float(re.search(r"need ([\d.]+) GB", disk.detail).group(1)) * 1e9
    assert abs(shown - need) <= 0.01e9, (shown, need)  # the planner's file estimate is within 0.3%


def _tiny_with_api_key(tmp_path):
    """tiny-cpu with service.api_key_ref: a systemd credential, or a managed process's 0600 copy."""
    text = (ROOT / "recipes" / "tiny-cpu.yaml").read_text()
    assert "  port: 18080\n" in text
    (tmp_path / "defaults.yaml").write_text((ROOT / "recipes" / "defaults.yaml").read_text())
    path = tmp_path / "tiny-keyed.yaml"
    path.write_text(text.replace("  port: 18080\n", "  port: 18080\n  api_key_ref: tiny-key\n"))
    return load_recipe(path)


NOT_BOOTED = system.SystemdState(systemd_running=False, booted=False, systemctl_present=True, state="offline")
NO_SYSTEMCTL = system.SystemdState(systemd_running=False, booted=False, systemctl_present=False)
MAINTENANCE = system.SystemdState(systemd_running=False, booted=True, systemctl_present=True, state="maintenance")
RUNNING = system.SystemdState(systemd_running=True, booted=True, systemctl_present=True, state="running")


EXL2 = "qwen2.5-32b-exl2-v100-16gb"
GPU_LLAMA = "qwen2.5-14b-v100-16gb"
# the fix, by what is wrong: boot with systemd (a warning or a block), or repair the one running
FIXES = {"warn": "boot the host with systemd for a service that survives reboots", "fail": "booted with systemd"}

# (systemd, recipe, status, blocking, words in the detail)
SYSTEMD_CASES = [
    # a llama.cpp recipe runs as a managed process where systemd does not: a warning
    (NOT_BOOTED, "tiny-cpu", "warn", False, ["state offline", "managed process", "not restarted at boot"]),
    (NO_SYSTEMCTL, "tiny-cpu", "warn", False, ["state absent", "managed process", "not restarted at boot"]),
    (NOT_BOOTED, GPU_LLAMA, "warn", False, ["managed process", "one server per GPU (`--gpus 0,1`) would need it"]),
    # what only a unit does blocks, and says why
    # TabbyAPI runs as a managed process too (its config, tokens and logs in its state directory)
    (NOT_BOOTED, EXL2, "warn", False, ["state offline", "managed process", "not restarted at boot"]),
    # a key reaches a managed process as a private copy (issue 31): no unit needed
    (NOT_BOOTED, "keyed", "warn", False, ["state offline", "managed process", "not restarted at boot"]),
    # no recipe: what a recipe would need is said, nothing blocks
    (NOT_BOOTED, None, "warn", False, ["managed process", "not restarted at boot; one server per GPU needs systemd"]),
    # PID 1 but unable to start units: deploy would use it, so it blocks whatever the recipe
    (MAINTENANCE, "tiny-cpu", "fail", True, ["state maintenance", "cannot start units"]),
    (MAINTENANCE, None, "fail", True, ["state maintenance", "cannot start units"]),
    (RUNNING, EXL2, "pass", False, ["state running"]),
    (RUNNING, None, "pass", False, ["state running"]),
]


@pytest.mark.parametrize(("sd", "recipe", "status", "blocking", "says"), SYSTEMD_CASES)
def test_systemd_is_judged_by_what_the_recipe_needs(tmp_path, sd, recipe, status, blocking, says):
    loaded = _tiny_with_api_key(tmp_path) if recipe == "keyed" else load_recipe(recipe) if recipe else None
    v = judge(facts(systemd=sd), loaded, "/opt/voltaforge/models", "/opt/voltaforge")
    c = by_name(v)["systemd"]
    assert (c.status, c.blocking) == (status, blocking), c
    assert all(w in c.detail for w in says), c.detail
    if status == "pass":
        assert c.fix == ""
    elif sd.booted:
        assert "systemctl is-system-running" in c.fix and "systemctl --failed" in c.fix
    else:
        assert FIXES[status] in c.fix, c.fix
    assert v.ok is not blocking  # nothing else blocks on these facts: the verdict is systemd's


def test_recipe_pinning_cuda_13_is_refused(tmp_path):
    from playbooks.config.recipe import RECIPES_DIR

    r = tmp_path / "r.yaml"
    r.write_text(
        (RECIPES_DIR / "qwen2.5-14b-v100-16gb.yaml")
        .read_text()
        .replace("config: models/", f"config: {RECIPES_DIR}/models/")
        + "toolchain:\n  cuda: '13.0'\n"
    )
    v = judge(facts(), load_recipe(r), "/opt/voltaforge/models", "/opt/voltaforge")
    assert by_name(v)["cuda-pin"].status == "fail" and "cannot target sm_70" in by_name(v)["cuda-pin"].detail


def test_hot_throttled_busy_gpu_is_flagged():
    f = facts()
    g = f.gpus.gpus[0]
    sick = g.model_copy(
        update={
            "temperature_c": 86,
            "clocks_event_reasons": ("hw_thermal_slowdown",),
            "persistence_mode": False,
            "memory_used_mib": 4096,
        }
    )
    v = judge(
        f.model_copy(update={"gpus": f.gpus.model_copy(update={"gpus": [sick]})}),
        load_recipe("qwen2.5-14b-v100-16gb"),
        "/opt/voltaforge/models",
        "/opt/voltaforge",
    )
    c = by_name(v)
    assert (
        c["thermal"].status == "warn" and "86 C" in c["thermal"].detail and "hw_thermal_slowdown" in c["thermal"].detail
    )
    assert c["persistence"].status == "warn" and "nvidia-persistenced" in c["persistence"].fix
    assert c["gpu-memory-in-use"].status == "warn" and "4096 MiB" in c["gpu-memory-in-use"].detail
    assert v.ok  # warnings, not blockers


def test_healthy_gpu_reports_its_temperature():
    v = judge(facts(), load_recipe("qwen2.5-14b-v100-16gb"), "/opt/voltaforge/models", "/opt/voltaforge")
    c = by_name(v)
    assert c["thermal"].status == "pass" and c["thermal"].detail == "GPU0 35 C"
    assert "persistence" not in c and "gpu-memory-in-use" not in c


def test_inventory_gpu_is_the_fallback_and_is_cross_checked():
    # no GPU seen: the inventory's kind is what the plan is judged against
    v = judge(
        facts(gpu_fixture=None),
        load_recipe("qwen2.5-32b-v100-32gb"),
        "/opt/voltaforge/models",
        "/opt/voltaforge",
        inventory_gpu="v100-32gb",
    )
    assert "Tesla V100-SXM2-32GB (the inventory's GPU: none seen on the host)" in by_name(v)["fit"].detail
    # the host reports a 16 GB V100 but the inventory claims an A100: flagged, the host wins
    v = judge(
        facts(),
        load_recipe("qwen2.5-14b-v100-16gb"),
        "/opt/voltaforge/models",
        "/opt/voltaforge",
        inventory_gpu="a100-40gb",
    )
    c = by_name(v)
    assert c["gpu-kind"].status == "warn" and "a100-40gb" in c["gpu-kind"].detail
    assert "Tesla V100-SXM2-16GB" in c["fit"].detail


def test_inventory_gpu_kind_ignores_form_factor_but_not_memory():
    args = (load_recipe("qwen2.5-14b-v100-16gb"), "/opt/voltaforge/models", "/opt/voltaforge")
    assert "gpu-kind" not in by_name(judge(facts(), *args, inventory_gpu="v100-pcie-16gb"))
    assert by_name(judge(facts(), *args, inventory_gpu="v100-32gb"))["gpu-kind"].status == "warn"
