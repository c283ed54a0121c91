"""voltaforge's Invoke tasks: the same collection for `invoke` in a checkout (tasks.py) and the
`voltaforge` console command of an installed wheel (playbooks/cli/main.py).

Thin by design: each task is declared once (command.py: its signature is its flags, its help
its own lines or the shared ones), reads flag > configuration > default (configured.py), types
the values in ``flags.py`` and calls one function, imported when the task runs so that one
task loads only what it needs.
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import replace
from pathlib import Path

from invoke import Collection, Context

from playbooks.cli import configured, flags
from playbooks.cli.command import command


@command(
    help={
        "recipe": "recipe name (recipes/NAME.yaml) or path (default: voltaforge.recipe in invoke.yaml)",
        "gpu": "plan for this GPU instead of the recipe's (e.g. v100-32gb, t4, a100-40gb)",
        "model-config": "plan a bare Hugging Face config.json instead of a recipe",
        "ctx": "tokens per slot (default: the recipe's, or 4096)",
        "parallel": "slots served at once (default: the recipe's, else 1)",
        "quant": "the quant to check, e.g. Q8_0 or EXL2-3.3 (default: the recipe's, else Q4_K_M)",
        "n-cpu-moe": "MoE models: keep the experts of the first N layers in host RAM (llama-server --n-cpu-moe); "
        "auto: the smallest N that fits (default: the recipe's; with --model-config, auto)",
        "host-membw": "host memory bandwidth in GB/s for the experts kept in host RAM (default: the recipe's "
        "planner.host_membw_gb_s, else 50)",
        "host-ram": "host RAM in GiB that the offloaded experts must fit (default: the recipe's, else unchecked)",
        "cache-type-k": "the KV cache type of K, as llama-server's -ctk (f16, q8_0, q4_0, ...; default: the "
        "recipe's, else f16)",
        "cache-type-v": "the KV cache type of V, as llama-server's -ctv (default: the recipe's, else f16; a "
        "quantized V needs flash attention, which the plan assumes on)",
        "min-tok-s": "the recommendation's speed floor: the best quality whose decode roofline reaches this many "
        "tok/s; none: the fastest (default: planner.min_tok_s, 30)",
        "gpu-count": "split the model by layers over this many cards of the GPU (default: the recipe's gpu_count, 1)",
        "tensor-split": "each card's share of the layers, as llama-server's --tensor-split (e.g. 3,1; default: "
        "the recipe's, else equal shares)",
        "split-mode": "how the cards share the model, as llama-server's --split-mode: layer (the default and "
        "the one planned; row and tensor get the reason they are not)",
        "models": "plan a model set instead: recipes served by one llama-server router (a,b,c), each alone and "
        "which can be resident together (--models-max)",
        "memory-budget": "with --models on a CPU target: the GiB the set's children may hold (default: the CPU "
        "target's)",
        "host": "plan the model sets this host's inventory entry serves (its GPU, or its memory_budget_gib)",
    },
)
def plan(
    c: Context,
    recipe: str | None = None,
    gpu: str | None = None,
    model_config: str | None = None,
    ctx: str | None = None,
    parallel: str | None = None,
    quant: str | None = None,
    n_cpu_moe: str | None = None,
    host_membw: str | None = None,
    host_ram: str | None = None,
    cache_type_k: str | None = None,
    cache_type_v: str | None = None,
    min_tok_s: str | None = None,
    gpu_count: str | None = None,
    tensor_split: str | None = None,
    split_mode: str | None = None,
    models: str | None = None,
    memory_budget: str | None = None,
    host: str | None = None,
    inventory: str | None = None,
    json: bool = False,
) -> int:
    """Compute the physical ceiling: weights, KV cache, VRAM budget, roofline, what fits."""
    from playbooks.cli.plan import run_plan

    # a set plans each member as its recipe says: a single recipe's flags would be ignored
    single = {
        "--recipe": recipe, "--model-config": model_config, "--ctx": ctx, "--parallel": parallel,
        "--quant": quant, "--n-cpu-moe": n_cpu_moe, "--host-membw": host_membw, "--host-ram": host_ram,
        "--cache-type-k": cache_type_k, "--cache-type-v": cache_type_v, "--min-tok-s": min_tok_s,
        "--gpu-count": gpu_count, "--tensor-split": tensor_split, "--split-mode": split_mode,
    }  # fmt: skip
    given = [flag for flag, value in single.items() if value is not None]
    if host is not None:
        from playbooks.cli.plan_set import run_plan_host_sets

        besides = given + [
            f for f, v in (("--models", models), ("--memory-budget", memory_budget), ("--gpu", gpu)) if v
        ]
        if besides:
            raise flags.UsageError(
                f"{', '.join(besides)}: --host plans the model sets its inventory entry names, on its GPU and budget"
            )
        return run_plan_host_sets(flags.one_host("--host", host), configured.settings(c, inventory), as_json=json)
    if inventory is not None:
        raise flags.UsageError("--inventory goes with --host (the host whose model sets are planned)")
    if models is not None:
        from playbooks.cli.plan_set import run_plan_set

        if given:
            raise flags.UsageError(
                f"{', '.join(given)}: --models plans each recipe of the set as it is written (drop the flag, "
                "or plan that recipe alone)"
            )

        return run_plan_set(
            flags.recipe_names("--models", models),
            gpu=flags.word("--gpu", gpu, "a GPU name, e.g. v100-32gb"),
            memory_gib=None
            if memory_budget is None
            else flags.positive_float("--memory-budget", memory_budget, "GiB", maximum=1048576),
            as_json=json,
            recipes_dir=configured.recipes_dir(c),
        )

    if memory_budget is not None:
        raise flags.UsageError("--memory-budget goes with --models (a set's budget on a CPU target)")
    return run_plan(
        recipe=flags.name_or_path(
            "--recipe", recipe if (recipe is not None or model_config) else configured.cfg(c, "recipe")
        ),
        gpu=gpu,
        model_config=model_config,
        ctx=flags.positive_int("--ctx", ctx, "tokens"),
        parallel=flags.positive_int("--parallel", parallel, "slots"),
        quant=quant,
        n_cpu_moe=flags.n_cpu_moe("--n-cpu-moe", n_cpu_moe),
        host_membw_gb_s=None
        if host_membw is None
        else flags.positive_float("--host-membw", host_membw, "GB/s", maximum=100000),
        host_ram_gib=None if host_ram is None else flags.positive_float("--host-ram", host_ram, "GiB", maximum=1048576),
        cache_type_k=flags.word("--cache-type-k", cache_type_k, "a cache type, e.g. q8_0"),
        cache_type_v=flags.word("--cache-type-v", cache_type_v, "a cache type, e.g. q8_0"),
        min_tok_s=flags.speed_floor("--min-tok-s", min_tok_s),
        gpu_count=flags.positive_int("--gpu-count", gpu_count, "cards", maximum=16),  # plan.split.MAX_DEVICES
        tensor_split=flags.shares("--tensor-split", tensor_split),
        split_mode=flags.split_mode("--split-mode", split_mode),
        as_json=json,
        recipes_dir=configured.recipes_dir(c),
    )


@command()
def preflight(
    c: Context, host: str | None = None, recipe: str | None = None, json: bool = False, inventory: str | None = None
) -> int:
    """Read a host's facts and judge them: each check with a fix; non-zero exit when blocked."""
    from playbooks.cli.preflight import run_preflight

    return run_preflight(
        configured.host(c, host),
        recipe=configured.recipe(c, recipe),
        as_json=json,
        settings=configured.settings(c, inventory),
    )


@command()
def toolchain(
    c: Context, host: str | None = None, recipe: str | None = None, dry_run: bool = False, inventory: str | None = None
) -> int:
    """Install the pinned CUDA toolkit and a venv with the pinned torch, idempotently."""
    from playbooks.cli.toolchain import run_toolchain

    return run_toolchain(
        configured.host(c, host),
        recipe=configured.recipe(c, recipe),
        dry_run=dry_run,
        settings=configured.settings(c, inventory),
    )


@command(
    help={
        "no-cache": "compile even when the fleet cache holds a proven build of the same inputs",
    },
)
def build(
    c: Context,
    host: str | None = None,
    recipe: str | None = None,
    dry_run: bool = False,
    inventory: str | None = None,
    no_cache: bool = False,
) -> int:
    """Build llama.cpp from the pinned source for the host's GPU arch, prove it, switch it in."""
    from playbooks.cli.build import run_build

    return run_build(
        configured.host(c, host),
        recipe=configured.recipe(c, recipe),
        dry_run=dry_run,
        settings=configured.settings(c, inventory),
        no_cache=no_cache,
    )


@command(
    help={
        "archive": "a tabbyAPI-<sha>.tar.gz made by `git archive` of the pinned commit (default: "
        "$VOLTAFORGE_TABBYAPI_ARCHIVE, else fetched from the repository)",
    }
)
def stage_tabbyapi(c: Context, archive: str | None = None, recipe: str | None = None) -> int:
    """Stage TabbyAPI's pinned commit on this controller, for hosts without GitHub."""
    from playbooks.cli.wheelhouse import run_stage_tabbyapi

    return run_stage_tabbyapi(flags.existing_file("--archive", archive), configured.recipe(c, recipe))


@command(help={"python": "the hosts' Python version, e.g. 3.11 (their toolchain venv's)"})
def wheelhouse(c: Context, python: str = "", recipe: str | None = None) -> int:
    """Download TabbyAPI's dependencies as wheels for hosts without a package index."""
    from playbooks.cli.wheelhouse import run_wheelhouse

    return run_wheelhouse(python, configured.recipe(c, recipe))


@command(
    help={
        "quant": "GGUF types to make, comma-separated (default: the recipe's quant), e.g. Q4_K_M,Q8_0",
        "bpw": "make an EXL2 quant of the recipe's model at this many bits per weight (2.0-8.0), e.g. 3.3",
        "force": "make a quant even when the plan says it cannot fit the recipe's GPU",
        "verify": "re-hash every artifact against its manifest instead of trusting size and mtime",
        "on": "make the artifacts on this host of the inventory (a CUDA host for EXL2) and copy them to --host",
    },
)
def quantize(
    c: Context,
    host: str | None = None,
    recipe: str | None = None,
    quant: str | None = None,
    bpw: str | None = None,
    dry_run: bool = False,
    force: bool = False,
    verify: bool = False,
    on: str | None = None,
    inventory: str | None = None,
) -> int:
    """Make the recipe's weights: fetched once, F16, imatrix, quants, each verified, with manifests."""
    from playbooks.cli.quantize import run_quantize

    return run_quantize(
        configured.host(c, host),
        recipe=configured.recipe(c, recipe),
        quant=quant,
        bpw=bpw,
        dry_run=dry_run,
        force=force,
        verify=verify,
        settings=configured.settings(c, inventory),
        on=flags.one_host("--on", on) if on is not None else None,
    )


@command(
    help={"json": "print JSON instead of a table"},
)
def artifacts(c: Context, host: str | None = None, json: bool = False, inventory: str | None = None) -> int:
    """List the verified model files on a host, from their manifests."""
    from playbooks.cli.quantize import run_artifacts

    return run_artifacts(configured.host(c, host), as_json=json, settings=configured.settings(c, inventory))


@command(
    help={
        "out": "directory to write into; files land at their host paths below it (DIR/etc/systemd/system/...)",
        "gpus": "GPU indexes, comma-separated (default 0, or 0..N-1 for a recipe split over N cards); several with "
        "a one-card recipe: one llama-server instance per GPU",
        "lb": "instead: the balancer this inventory host would run (`invoke lb --host LB`), from the inventory",
        "hosts": "with --lb: the hosts whose servers it balances, comma-separated (default: the lb: entry's)",
        "bind": "with --lb: the address it listens on (default: the lb: entry's, else 127.0.0.1)",
        "port": "with --lb: the port it listens on (default: the lb: entry's, else 8000)",
        "tls": "with --lb: on or off (default: on beyond loopback)",
        "host": "instead: every file this inventory host would get (its layout's recipes, GPUs, ports, "
        "instances, RPC worker units), from the inventory",
    },
)
def render(
    c: Context,
    recipe: str | None = None,
    out: str | None = None,
    gpus: str | None = None,
    host: str | None = None,
    lb: str | None = None,
    hosts: str | None = None,
    bind: str | None = None,
    port: str | None = None,
    tls: str | None = None,
    inventory: str | None = None,
) -> int:
    """Write every file deploy would install for a recipe into a local directory.

    The units, env files and configs; needs no host. With --lb: the balancer's."""
    from playbooks.cli.render_files import output_dir, run_render, run_render_host, run_render_lb

    # every flag checked whatever the mode: junk is one line, never ignored
    lb_hosts = flags.host_names("--hosts", hosts) if hosts is not None else None
    lb_bind = flags.ip_address("--bind", bind) if bind is not None else None
    lb_port = flags.positive_int("--port", port, "a TCP port", maximum=65535) if port is not None else None
    lb_tls = None if tls is None else flags.choice("--tls", tls, ("on", "off")) == "on"
    settings = configured.settings(c, inventory)
    if lb is not None:
        return run_render_lb(
            flags.one_host("--lb", lb),
            lb_hosts,
            output_dir(out),
            settings,
            recipe=configured.recipe(c, recipe),
            bind=lb_bind,
            port=lb_port,
            tls=lb_tls,
        )
    given = {"--hosts": hosts, "--tls": tls, "--bind": bind, "--port": port}
    stray = [name for name, value in given.items() if value is not None]
    if stray:
        raise flags.UsageError(
            f"{', '.join(stray)} {'go' if len(stray) > 1 else 'goes'} with --lb (the balancer's files)"
        )
    if host is not None:
        mixed = [name for name, value in {"--recipe": recipe, "--gpus": gpus}.items() if value is not None]
        if mixed:
            raise flags.UsageError(f"{', '.join(mixed)}: --host renders what the inventory gives that host")
        return run_render_host(flags.one_host("--host", host), output_dir(out), settings)
    if inventory is not None:
        raise flags.UsageError("--inventory goes with --host or --lb (what the inventory gives a host)")
    return run_render(
        recipe=configured.recipe(c, recipe),
        out=output_dir(out),
        gpus=flags.gpu_indexes(gpus),
        recipes_dir=configured.recipes_dir(c),
        prefix=flags.install_prefix("voltaforge.prefix", configured.cfg(c, "prefix")),
    )


@command(
    help={
        "dry-run": "show the diff of every file and the commands; change nothing",
        "manager": "auto (systemd where it runs, else a managed process), systemd, or process",
        "gpus": "GPU indexes, comma-separated (default 0, or 0..N-1 for a recipe split over N cards); several with "
        "a one-card recipe: one llama-server instance per GPU",
    },
)
def deploy(
    c: Context,
    host: str | None = None,
    recipe: str | None = None,
    dry_run: bool = False,
    manager: str = "auto",
    gpus: str | None = None,
    inventory: str | None = None,
) -> int:
    """Install and start the recipe's server; roll back to the last good one on failure.

    From the rendered files and the verified model; /health and the load log are checked
    against the plan."""
    from playbooks.cli.deploy import run_deploy

    return run_deploy(
        configured.host(c, host),
        recipe=configured.recipe(c, recipe),
        dry_run=dry_run,
        manager=flags.choice("--manager", manager, ("auto", "systemd", "process")),
        settings=configured.settings(c, inventory),
        gpus=flags.gpu_indexes(gpus),
    )


@command(
    help={
        "dry-run": "show what would change and the commands; change nothing",
    },
)
def rpc_worker(
    c: Context, host: str | None = None, recipe: str | None = None, dry_run: bool = False, inventory: str | None = None
) -> int:
    """Run the recipe's llama.cpp RPC workers on a host (a model split across hosts).

    The host's toolchain and llama.cpp build, then one hardened ggml-rpc-server unit per rpc:
    entry of the recipe whose worker is this host, listening on its endpoint only."""
    from playbooks.cli.rpc_worker import run_rpc_worker

    return run_rpc_worker(
        configured.host(c, host),
        recipe=configured.recipe(c, recipe),
        dry_run=dry_run,
        settings=configured.settings(c, inventory),
    )


@command(
    help={
        "host": "the host that runs the balancer",
        "hosts": "the hosts whose servers it balances, comma-separated (default: the inventory's lb: hosts)",
        "recipe": "only that recipe's servers (default: every server the hosts' deployment records name)",
        "bind": "the address it listens on (default: lb: bind, else 127.0.0.1; another needs a key)",
        "port": "the port it listens on (default: lb: port, else 8000)",
        "tls": "on or off: HTTPS at the edge (default: on beyond loopback, a self-signed pair unless --cert)",
        "cert": "the certificate HAProxy presents (PEM file here; with --key)",
        "key": "its private key (PEM file here, unencrypted)",
        "dry-run": "show what would change and the commands; change nothing",
        "stop": "stop the balancer (and disable its unit); its records leave the backend hosts",
        "remove": "stop it and remove its unit, configuration, TLS pair and state, and its records",
    },
)
def lb(
    c: Context,
    host: str | None = None,
    hosts: str | None = None,
    recipe: str | None = None,
    bind: str | None = None,
    port: str | None = None,
    tls: str | None = None,
    cert: str | None = None,
    key: str | None = None,
    dry_run: bool = False,
    inventory: str | None = None,
    stop: bool = False,
    remove: bool = False,
) -> int:
    """One TLS endpoint for a fleet's servers, routed by model name: HAProxy, health-checked.

    Every server the hosts' deployment records say they serve, grouped by served model name,
    each taking its slots (the rest wait at the edge). Flags left out come from the
    inventory's lb: entry. Debian's haproxy, a hardened unit (or a managed process)."""
    from playbooks.cli.balancer import run_lb

    return run_lb(
        # --host, else the inventory's lb: host, else the configuration's host
        flags.one_host("--host", host) if host is not None else None,
        flags.host_names("--hosts", hosts) if hosts is not None else None,
        recipe=configured.recipe(c, recipe),
        bind=flags.ip_address("--bind", bind) if bind is not None else None,
        port=flags.positive_int("--port", port, "a TCP port", maximum=65535) if port is not None else None,
        tls=None if tls is None else flags.choice("--tls", tls, ("on", "off")) == "on",
        cert=str(flags.existing_file("--cert", cert)) if cert is not None else None,
        key=str(flags.existing_file("--key", key)) if key is not None else None,
        dry_run=dry_run,
        settings=configured.settings(c, inventory),
        default_host=flags.one_host("--host", configured.cfg(c, "host")),
        stop=stop,
        remove=remove,
    )


@command(
    help={
        "host": "the host that runs Prometheus (default: monitor: host, else the configuration's host)",
        "hosts": "the hosts it watches, comma-separated (default: monitor: hosts, else every inventory host)",
        "bind": "the address Prometheus listens on (default: monitor: bind, else 127.0.0.1)",
        "port": "the port Prometheus listens on (default: monitor: port, else 9090)",
        "dry-run": "show what would change and the commands; change nothing",
        "stop": "stop Prometheus and every host's exporters (and disable their units); their files stay",
        "remove": "stop them and remove their units, programs, Prometheus's configuration and data",
    },
)
def monitor(
    c: Context,
    host: str | None = None,
    hosts: str | None = None,
    bind: str | None = None,
    port: str | None = None,
    dry_run: bool = False,
    inventory: str | None = None,
    stop: bool = False,
    remove: bool = False,
) -> int:
    """One Prometheus for the fleet: every server, the edge, each host's node and GPU exporter.

    Targets from the hosts' deployment records (a keyed server scraped with its key from a
    0600 credential), flags over the inventory's monitor: entry. Debian's packages, never
    started on install; hardened units (or managed processes), on loopback unless told.
    --stop / --remove take it down again (Debian's packages stay)."""
    from playbooks.cli.monitor import run_monitor

    return run_monitor(
        flags.one_host("--host", host) if host is not None else None,
        flags.host_names("--hosts", hosts) if hosts is not None else None,
        bind=flags.ip_address("--bind", bind) if bind is not None else None,
        port=flags.positive_int("--port", port, "a TCP port", maximum=65535) if port is not None else None,
        dry_run=dry_run,
        settings=configured.settings(c, inventory),
        default_host=flags.one_host("--host", configured.cfg(c, "host")),
        stop=stop,
        remove=remove,
    )


@command(
    help={
        "host": "the host that runs Prometheus (default: monitor: host, else the configuration's host)",
        "interval": "seconds between redraws on a terminal (default 2)",
        "once": "one snapshot, then exit (what a pipe or a file gets anyway)",
    },
)
def top(
    c: Context,
    host: str | None = None,
    interval: str | None = None,
    once: bool = False,
    inventory: str | None = None,
) -> int:
    """The fleet live from the monitor's Prometheus: its servers and its GPUs, a row each.

    Per server its state, tokens/s, slots busy, KV use and requests waiting; per GPU its clock,
    temperature, power and what holds it down. Redrawn in place on a terminal until Ctrl-C; one
    snapshot when piped. Needs `invoke monitor`."""
    from playbooks.cli.top import run_top

    return run_top(
        flags.one_host("--host", host) if host is not None else None,
        interval_s=flags.positive_float("--interval", interval, "seconds", maximum=3600)
        if interval is not None
        else 2.0,
        once=once,
        settings=configured.settings(c, inventory),
        default_host=flags.one_host("--host", configured.cfg(c, "host")),
    )


@command()
def stop(c: Context, host: str | None = None, recipe: str | None = None, inventory: str | None = None) -> int:
    """Stop the recipe's server on a host (the unit, or the managed process); its files stay.

    Without a recipe: the one the host's deployment record says it serves."""
    from playbooks.cli.deploy import run_stop

    return run_stop(
        configured.host(c, host),
        recipe=configured.recipe(c, recipe),
        settings=configured.settings(c, inventory),
    )


@command(
    help={
        "recipe": "only this recipe's servers and RPC workers (default: every deployment on the host)",
        "dry-run": "list what would be stopped and removed; change nothing",
    }
)
def remove(
    c: Context, host: str | None = None, recipe: str | None = None, dry_run: bool = False, inventory: str | None = None
) -> int:
    """Stop and remove a host's deployments: units, configuration, state, the model's links.

    Weights and builds stay (shared, verified by hash). --dry-run lists what goes."""
    from playbooks.cli.deploy import run_remove

    return run_remove(
        configured.host(c, host),
        recipe=configured.recipe(c, recipe),
        dry_run=dry_run,
        settings=configured.settings(c, inventory),
    )


@command(
    help={
        "objective": "single (one stream's decode, default), aggregate (every slot busy) or latency (TTFT p95)",
        "quants": "GGUF types to try, comma-separated (default: the recipe's); missing ones are made",
        "cache": "KV cache types to try: f16,q8_0 or K/V pairs like q8_0/q4_0 (default: the recipe's and f16)",
        "flash-attn": "on, off or on,off (default: the recipe's)",
        "slots": "try 1..N slots (--parallel; default: the recipe's)",
        "ubatch": "physical batch sizes (-ub) to try (default: the recipe's and 64)",
        "spec": "speculative decoding types to try: none, ngram-mod, ngram-simple, ngram-map-k, draft-simple "
        "(the recipe's draft model)",
        "threads": "llama.cpp CPU thread counts to try (-t/-tb), e.g. 1,2 (default: the recipe's)",
        "min-ctx": "tokens every slot must hold (default: the recipe's context)",
        "min-bpw": "the quality floor in bits per weight (default: none)",
        "budget": "wall-clock budget, e.g. 45m, 90s, 1h30m (default 45m): the search ends within it plus one "
        "measurement (each predicted from its plan, corrected as measured); the best so far when it runs out",
        "rungs": "successive-halving rounds (default 3): each measures the better half twice as long",
        "take-over": "stop the live service for the search when a candidate cannot fit beside it; restored after",
        "port": "the scratch server's port (default: the recipe's + 100)",
        "remeasure": "measure every candidate again instead of reusing kept measurements (kept ones are reused "
        "only on the same host facts and for 7 days)",
        "json": "print the whole result as JSON instead of the table",
        "dry-run": "connect to nothing: print the space, the pruning, the measuring order and a predicted time",
        "gpu": "with --dry-run: plan the recipe for this card instead of its own (e.g. v100-32gb)",
    },
)
def tune(
    c: Context,
    host: str | None = None,
    recipe: str | None = None,
    objective: str = "single",
    quants: str | None = None,
    cache: str | None = None,
    flash_attn: str | None = None,
    slots: str | None = None,
    ubatch: str | None = None,
    spec: str | None = None,
    threads: str | None = None,
    min_ctx: str | None = None,
    min_bpw: str | None = None,
    budget: str = "45m",
    rungs: str | None = None,
    take_over: bool = False,
    port: str | None = None,
    remeasure: bool = False,
    json: bool = False,
    dry_run: bool = False,
    gpu: str | None = None,
    inventory: str | None = None,
) -> int:
    """Search the served configuration on the host and write the winner as a recipe.

    Guided by the roofline: every candidate planned (what cannot fit is pruned), served on a
    scratch port, benched with confidence; ties go to the simpler configuration."""
    from playbooks.cli.tune import options, run_tune, run_tune_preview

    opts = options(
        objective=str(objective).strip(),
        quants=quants,
        cache=cache,
        flash_attn=flash_attn,
        slots=flags.positive_int("--slots", slots, "slots", 64),
        ubatch=ubatch,
        spec=spec,
        min_ctx=flags.positive_int("--min-ctx", min_ctx, "tokens", 1 << 20),
        min_bpw=flags.positive_float("--min-bpw", min_bpw, "bits per weight", 32) if min_bpw is not None else None,
        budget=budget,
        rungs=flags.positive_int("--rungs", rungs, "rungs", 8),
        take_over=take_over,
        port=flags.positive_int("--port", port, "a port", 65535),
        threads=threads,
        remeasure=remeasure,
    )
    if dry_run:
        named_host = configured.cfg(c, "host", host)
        return run_tune_preview(
            flags.one_host("--host", named_host) if named_host is not None else None,
            recipe=configured.recipe(c, recipe),
            opts=opts,
            gpu=flags.word("--gpu", gpu, "a GPU name, e.g. v100-16gb"),
            as_json=json,
            settings=configured.settings(c, inventory),
        )
    if gpu is not None:
        raise flags.UsageError("--gpu goes with --dry-run: a real search measures the host's own card")
    return run_tune(
        configured.host(c, host),
        recipe=configured.recipe(c, recipe),
        opts=opts,
        as_json=json,
        settings=configured.settings(c, inventory),
    )


@command(
    help={
        "json": "print the whole result as JSON instead of the table",
        "compare": "show the change against the last and the best run of this host and recipe",
        "remeasure": "measure the host's memory bandwidth again instead of reusing the stored figure",
        "lb": "measure through the balancer on --host (invoke lb) on this port, with each backend's share",
        "noise": "bench the unchanged server N times (e.g. 4) and report this host's run-to-run noise, which "
        "--compare and tune count (kept with the bench history)",
        "against": "serve RECIPE beside the deployed server (on its port + 100) and measure both in one run, "
        "interleaved, with the change of RECIPE against it per level",
    },
)
def bench(
    c: Context,
    host: str | None = None,
    recipe: str | None = None,
    json: bool = False,
    compare: bool = False,
    remeasure: bool = False,
    lb: str | None = None,
    noise: str | None = None,
    against: str | None = None,
    inventory: str | None = None,
) -> int:
    """Measure the deployed server against its roofline and judge the gate (exit 1: failed).

    A concurrency sweep with confidence intervals, telemetry, JSON/Markdown/PNG reports and a
    history on this machine. Without a recipe: the one the host's deployment record says it
    serves (a host's serve: layout: each of its servers). --lb PORT: the same workload through
    the host's balancer, with each backend's share of the requests (no gate). --noise N: N runs
    of the unchanged server, then the host's run-to-run noise from its history. --against RECIPE:
    RECIPE served beside the deployed server and both measured in one run, their rounds
    interleaved (A B B A), with RECIPE's change per level (no gate, no history)."""
    from playbooks.cli.bench import run_bench, run_bench_against, run_bench_lb, run_bench_noise

    if against is not None:
        besides = [
            f for f, v in (("--compare", compare), ("--remeasure", remeasure), ("--lb", lb), ("--noise", noise)) if v
        ]
        if besides:
            raise flags.UsageError(f"{', '.join(besides)}: --against measures two servers in one run, alone")
        return run_bench_against(
            configured.host(c, host),
            flags.name_or_path("--against", against) or "",
            recipe=configured.recipe(c, recipe),
            as_json=json,
            settings=configured.settings(c, inventory),
        )
    if noise is not None:
        return run_bench_noise(
            configured.host(c, host),
            flags.positive_int("--noise", noise, "runs", maximum=50) or 1,
            recipe=configured.recipe(c, recipe),
            as_json=json,
            settings=configured.settings(c, inventory),
        )
    if lb is not None:
        return run_bench_lb(
            configured.host(c, host),
            port=flags.positive_int("--lb", lb, "a TCP port", maximum=65535) or 8000,
            recipe=configured.recipe(c, recipe),
            as_json=json,
            settings=configured.settings(c, inventory),
        )
    return run_bench(
        configured.host(c, host),
        recipe=configured.recipe(c, recipe),
        as_json=json,
        show_compare=compare,
        settings=configured.settings(c, inventory),
        remeasure=remeasure,
    )


@command(
    help={
        "host": "one host or several, comma-separated, read at once (default: voltaforge.host, else local)",
        "json": "print JSON instead of a table",
    },
)
def status(c: Context, host: str | None = None, json: bool = False, inventory: str | None = None) -> int:
    """Show what each host serves, from its deployment records.

    Recipe, model, port, /health, the unit or process and its uptime, the last gate's figures;
    exit 1 when a host cannot be read."""
    from playbooks.cli.status import run_status

    return run_status(
        flags.host_names("--host", configured.cfg(c, "host", host)),
        as_json=json,
        settings=configured.settings(c, inventory),
    )


def _typed_provision(
    host: str | None, recipe: str | None, inventory: str | None, drain_timeout: float | None, rebench: bool
) -> str:
    """The provision command as typed, for the fix line: without --dry-run and --json."""
    words = ["invoke", "provision"]
    for flag, value in (("--host", host), ("--recipe", recipe), ("--inventory", inventory)):
        if value is not None:
            words += [flag, str(value)]
    if drain_timeout is not None:
        words += ["--drain-timeout", str(drain_timeout)]
    return shlex.join(words + (["--rebench"] if rebench else []))


@command(
    klass=flags.ShortFlagTask,
    help={
        "host": "one host or several, comma-separated, provisioned at once (default: voltaforge.host, else local)",
        "recipe": "recipe name or path (default: each host's in the inventory, else voltaforge.recipe, else tiny-cpu)",
        "dry-run": "print every step's commands and change nothing",
        "rebench": "run the gate's benchmark even when this deployment already passed it",
        "json": "also write the summary as JSON to this file",
        "verbose": "every line live (commands, compiler, pip), as the log has them; quiet by default",
        "drain-timeout": "seconds a server drained on its balancer may take to finish its requests before it is "
        "changed anyway (default 300)",
        "in-place": "change in place the servers of a balancer whose runtime API does not answer (HAProxy stopped "
        "or gone: nothing is served through it) instead of failing",
    },
)
def provision(
    c: Context,
    host: str | None = None,
    recipe: str | None = None,
    dry_run: bool = False,
    rebench: bool = False,
    json: str | None = None,
    inventory: str | None = None,
    verbose: bool = False,
    drain_timeout: float | None = None,
    in_place: bool = False,
) -> int:
    """Everything, in order, on one host or many, up to a passed benchmark gate.

    Preflight, toolchain, build, quantize, deploy and the gate; each step ok when already
    right; a failed gate rolls back; a re-run resumes. With no flags: the tiny CPU recipe on
    this machine."""
    from playbooks.cli.provision import run_provision
    from playbooks.conduct.provision import DEFAULT_RECIPE, Options
    from playbooks.conduct.roll import DRAIN_BOUND_S

    return run_provision(
        flags.host_names("--host", configured.cfg(c, "host", host)),
        recipe=flags.name_or_path("--recipe", recipe),
        default_recipe=flags.name_or_path("voltaforge.recipe", configured.cfg(c, "recipe")) or DEFAULT_RECIPE,
        options=Options(
            dry_run=dry_run,
            rebench=rebench,
            command=_typed_provision(host, recipe, inventory, drain_timeout, rebench),
            drain_timeout_s=DRAIN_BOUND_S
            if drain_timeout is None
            else flags.positive_float("--drain-timeout", drain_timeout, "seconds", 3600),
        ),
        settings=replace(configured.settings(c, inventory), in_place=in_place),
        json_out=flags.output_file("--json", json),
        verbose=verbose,
    )


VERIFY_USAGE = """Usage: invoke verify-recipe RECIPE [--reports DIR]

  Provision RECIPE on this machine with the benchmark gate measured afresh (what the GPU
  runner's workflow runs for each recipe); the gate's JSON/Markdown/PNG reports and
  provision.json land in DIR (default: reports/RECIPE). Exit 0: the gate passed; 1: a step or
  the gate failed; 2: bad input."""


@command(
    positional=["recipe"],
    help={
        "recipe": "the recipe to prove on this machine's GPU (name or path)",
        "reports": "directory for the gate's JSON/Markdown/PNG reports and provision.json (default: reports/RECIPE)",
    },
)
def verify_recipe(c: Context, recipe: str | None = None, reports: str | None = None) -> int:
    """What the GPU runner runs (ci/): provision a recipe here, the gate measured afresh.

    The reports land in --reports; exit 1 when the gate fails."""
    from playbooks.cli.provision import run_provision
    from playbooks.conduct.provision import Options

    if recipe in ("-h", "--help"):  # a positional argument takes the next word, even --help
        print(VERIFY_USAGE)
        return 0
    name = flags.name_or_path("RECIPE", recipe)
    if name is None:
        raise flags.UsageError("verify-recipe: name the recipe, e.g. `invoke verify-recipe qwen2.5-14b-v100-16gb`")
    where = flags.output_dir("--reports", reports if reports is not None else f"reports/{Path(name).stem}")
    return run_provision(
        ["local"],
        recipe=name,
        options=Options(rebench=True, reports=where),
        settings=configured.settings(c, None),
        json_out=where / "provision.json",
    )


@command(
    help={
        "k": "only tests matching this pytest -k expression",
        "fast": "skip tests marked slow",
        "workers": "pytest-xdist workers (default: the cores, at most 4; 1 runs the tests in one process)",
    }
)
def test(c: Context, k: str | None = None, fast: bool = False, workers: str | None = None) -> None:
    """Run the test suite (what .ci/run runs): ruff, mypy, then pytest."""
    n = flags.positive_int("--workers", workers, "workers") or min(4, os.cpu_count() or 1)
    # the interpreter running invoke, so the venv's tools are used whatever PATH says
    py = shlex.quote(sys.executable)
    c.run(f"{py} -m ruff check playbooks tests scripts tasks.py", pty=False)
    c.run(f"{py} -m ruff format --check playbooks tests scripts tasks.py", pty=False)
    c.run(f"{py} -m mypy", pty=False)
    # the slowest tests named at the end: where the suite's time goes, in every CI log
    args = [sys.executable, "-m", "pytest", "-q", "--durations=25"]
    # many tests wait (servers, containers, SSH) or use one core (Python): a second worker
    # fills that time; worksteal, as the real tests' lengths are uneven (seconds to minutes).
    # No xdist_group: pytest 9.2 ignores the test ids xdist 3.8 rewrites for --dist loadgroup.
    if n > 1:
        args += ["-n", str(n), "--dist", "worksteal"]
    if k:
        args += ["-k", k]
    if fast:
        args += ["-m", "not slow"]
    c.run(" ".join(shlex.quote(a) for a in args), pty=False)


ns = Collection(
    plan,
    preflight,
    toolchain,
    build,
    stage_tabbyapi,
    wheelhouse,
    quantize,
    artifacts,
    render,
    deploy,
    stop,
    remove,
    rpc_worker,
    lb,
    monitor,
    top,
    bench,
    status,
    tune,
    provision,
    verify_recipe,
    test,
)
ns.configure(configured.DEFAULTS)
