"""`invoke tune`: search the served configuration on the real host, guided by the roofline, and
keep what measurably wins.

The loop, per host (compute first, act second):

1. The space (steps/measure/tune_space.py): the recipe's levers, each candidate planned; what cannot
   fit or breaks a rule is pruned with a count per reason; the rest is ordered by predicted
   speed.
2. The live service: when the plan says a candidate fits beside it (its memory and the
   candidate's within the card, or the host's RAM for a CPU server), it keeps serving
   untouched and is checked between candidates. When not, tune refuses unless
   ``--take-over``: then the live service is stopped for the search and deployed again at
   the end, after a failure and after Ctrl-C.
3. Each candidate: its artifact reused (made by the quantize step only when missing), served
   by the deploy step's own operations under a scratch unit (``voltaforge-tune``) on a
   scratch port, benched with the bench's repeats (steps/bench_run.measure_level), stopped.
   Successive halving (steps/measure/tune_search.py) measures the promising ones longer, within the
   budget. A measurement is kept by its inputs (the build, the artifact's sha256, the unit's
   command line, the workload) with the host facts it depends on (kernel, CPU, GPU and driver,
   the bandwidth fact) and its time, so a re-run measures nothing it already has, unless those
   facts changed, it is older than ``max_age_days`` (7) or ``--remeasure``.
4. The winner (ties to the simpler configuration) is written as a recipe with a comment saying
   how it was found, into the user's recipes directory, never the installed package; the
   table, a chart and the JSON go under ``~/.cache/voltaforge/tune/<host>/<recipe>/<time>/``.

Not searched here: EXL2 bit rates (the EXL2 path has not run on a GPU), `--n-cpu-moe` (the planner picks the
smallest that fits; more only loses speed).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from playbooks.conduct.deploy import deploy_ops
from playbooks.conduct.deployed import deployment_manager, recipe_file
from playbooks.conduct.placements import Served, host_serves
from playbooks.conduct.scratch import SCRATCH_SERVICES, Ops, Scratch, crowded, planned_bytes, scratch_ops
from playbooks.conduct.settings import Settings
from playbooks.conduct.tune_candidates import (
    candidate_recipe,
    measurement_key,
    rung_gate,
    winner_recipe_text,
    write_winner,
)
from playbooks.conduct.tune_store import keep_row, kept_level, store_path, stored_rows
from playbooks.config.recipe import LoadedRecipe, load_recipe
from playbooks.errors import VoltaforgeError
from playbooks.facts import builds as build_facts
from playbooks.facts import read_fact
from playbooks.facts.deployments import Deployment, deployments_command, parse_deployments
from playbooks.facts.files import parse_writable, writable_command
from playbooks.facts.provenance import Provenance, parse_provenance, provenance_command
from playbooks.host import Host
from playbooks.host.lock import host_lock
from playbooks.host.ops import run_command, run_ops
from playbooks.host.output import Printer
from playbooks.plan.engines import engine
from playbooks.plan.gpus import get_gpu
from playbooks.steps.measure import tune_report
from playbooks.steps.measure.bench_ceilings import host_membw, host_python
from playbooks.steps.measure.bench_history import read_history
from playbooks.steps.measure.bench_noise import counted_or_borrowed, host_noise
from playbooks.steps.measure.bench_run import bench_dir, bench_health, measure_level
from playbooks.steps.measure.tune_cost import plan_costs, streams_for
from playbooks.steps.measure.tune_search import (
    Budget,
    Measured,
    Verdict,
    choose,
    combined,
    contenders,
    drift,
    interleave,
    rung_drift,
    successive_halving,
)
from playbooks.steps.measure.tune_space import Candidate, Objective, Space, base_candidate, enumerate_space, prune
from playbooks.steps.serve.secrets import api_key_for
from playbooks.steps.serve.service_files import planned_service_files


@dataclass(frozen=True)
class Levers:
    """What tune may move (empty: the recipe's value only)."""

    quants: tuple[str, ...] = ()
    caches: tuple[tuple[str, str], ...] = ()
    flash_attn: tuple[bool, ...] = ()
    slots: tuple[int, ...] = ()
    ubatches: tuple[int, ...] = ()
    spec_types: tuple[str | None, ...] = ()
    threads: tuple[int, ...] = ()


@dataclass(frozen=True)
class TuneOptions:
    objective: Objective = "single"
    levers: Levers = Levers()
    min_ctx: int | None = None
    min_bpw: float | None = None
    budget_s: float = 45 * 60
    rungs: int = 3
    take_over: bool = False
    port: int | None = None  # the scratch port (default: the recipe's + 100)
    recipes_dir: Path | None = None  # where the winner is written (default ./recipes)
    remeasure: bool = False  # measure every candidate again, whatever is stored
    max_age_days: float = 7.0  # a stored measurement older than this is measured again


@dataclass
class Outcome:
    space: Space
    measured: list[Measured] = field(default_factory=list)
    verdict: Verdict | None = None
    ran_out: bool = False
    budget: Budget | None = None
    blocks: list[Measured] = field(default_factory=list)  # the contenders' interleaved blocks
    quants_s: float = 0.0  # making the quants the candidates need, before the budget's clock
    live: dict[str, Any] = field(default_factory=dict)
    winner_recipe: Path | None = None
    report_dir: Path | None = None
    result: dict[str, Any] = field(default_factory=dict)


class Tuner:
    """One tune run on one connected host."""

    def __init__(
        self,
        host: Host,
        prefix: str,
        loaded: LoadedRecipe,
        opts: TuneOptions,
        ops: Ops,
        say: Callable[[str], None] = lambda _: None,
        cache_root: Path | None = None,
    ):
        self.host, self.prefix, self.loaded, self.opts, self.ops, self.say = host, prefix, loaded, opts, ops, say
        r = loaded.recipe
        self.context = max(r.context, opts.min_ctx or 0)
        self.port = opts.port or r.service.port + 100
        self.scratch = Scratch(host, prefix, ops, say)
        self.store = store_path(host.name, r.name, cache_root)
        self.root = self.store.parent
        self.live_checks: list[tuple[str, int]] = []
        self.build = ""
        self.provenance = Provenance()  # the host facts a measurement depends on (read in run)
        # the between-run noise every comparison counts: the recipe's own figure, else the
        # host's from its bench history (bench_noise), else the 2-core VM's defaults, said so
        own = host_noise(read_history(bench_dir() / "history.jsonl", host.name))
        self.noise = counted_or_borrowed(host.name, r.gate.run_noise, own)
        self.bandwidth: float | None = None
        self.kld: dict[str, float] = {}  # quant -> mean KL divergence against F16 (its manifest)
        self._live: list[Deployment] | None = None
        self.took_over = False  # the live service was stopped for the search (and is restored)

    # -- facts -------------------------------------------------------------------------------

    def live_services(self) -> list[Deployment]:
        """The host's deployments besides tune's own, read once per run (their ports do not
        move during a search: a taken-over service comes back on its own)."""
        if self._live is None:
            found = parse_deployments(read_fact(self.host, deployments_command(self.prefix)))
            self._live = [d for d in found if d.service not in SCRATCH_SERVICES and d.record]
        return self._live

    def _port_of(self, d: Deployment) -> int | None:
        port = (d.record or {}).get("port")
        return int(port) if isinstance(port, int) else None

    def check_live(self, when: str) -> None:
        for d in self.live_services():
            port = self._port_of(d)
            if port is not None:
                self.live_checks.append((when, bench_health(self.host, port)))

    def fits_beside(self, space: Space, live: Sequence[Deployment]) -> str | None:
        """Why the candidates do not fit beside the live service (None: they do)."""
        biggest = max((p.option.vram_bytes for p in space.survivors), default=0)
        return crowded(
            self.loaded.recipe.gpu,
            "a candidate",
            biggest,
            [(d.service, self._live_bytes(d)) for d in live],
            "pass --take-over to stop it for the search (it is deployed again at the end)",
        )

    def _live_bytes(self, d: Deployment) -> int:
        recorded = d.recipe
        try:
            loaded = load_recipe(recorded.path) if recorded and Path(recorded.path).is_file() else self.loaded
        except VoltaforgeError:
            loaded = self.loaded
        return planned_bytes(loaded)

    # -- one candidate ------------------------------------------------------------------------

    def artifact(self, c: Candidate, cand: LoadedRecipe) -> str:
        """The sha256 of the candidate's GGUF, from its manifest (the GGUF made by the quantize
        step when the manifest is missing); its KL divergence noted where the manifest has it."""
        facts = self.scratch.artifact(cand, c.quant)
        kld = ((facts.get("verification") or {}).get("kld") or {}).get("mean_kld")
        if isinstance(kld, (int, float)):
            self.kld[c.quant] = float(kld)
        return str(facts.get("sha256") or "")

    def make_quants(self, space: Space) -> float:
        """Every quant the survivors need, verified or made now (the quantize step), before the
        budget's clock starts; the seconds it took."""
        t0 = time.monotonic()
        seen: set[str] = set()
        for p in space.survivors:
            c = p.candidate
            if c.quant in seen:
                continue
            seen.add(c.quant)
            try:
                self.artifact(c, candidate_recipe(self.loaded, c, self.port, self.context))
            except VoltaforgeError:
                pass  # the candidate's measurement reports it, in the table
        took = time.monotonic() - t0
        self.say(f"the quants the candidates need are ready ({took:.0f} s, outside the budget)")
        return took

    def measure(self, c: Candidate, rung: int, block: int | None = None, reference: bool = False) -> Measured:
        """One candidate at one rung (``block``: one of the finalists' interleaved blocks at
        that rung, kept under its own key; ``reference``: the previous rung's leader again at
        its rung's workload, always measured afresh, since what it shows is the machine now)."""
        cand = candidate_recipe(self.loaded, c, self.port, self.context)
        conc = streams_for(self.opts.objective, c)
        g = rung_gate(cand.recipe.gate, rung, conc)
        workload: dict[str, Any] = {"prompt_tokens": g.prompt_tokens, "max_tokens": g.max_tokens, "concurrency": conc}
        if g.workload != "chat":  # (chat: the key measurements were kept under before kinds existed)
            workload["kind"] = g.workload
        workload["rung"] = rung
        if block is not None:
            workload["block"] = block
        if reference:
            workload["reference"] = True
        workload |= {"least": g.requests_per_level, "most": g.max_requests_per_level, "ci_target": g.ci_target}
        try:
            sha = self.artifact(c, cand)
        except VoltaforgeError as exc:
            return Measured(c, rung, error=str(exc))
        unit_text = self._unit_text(cand)
        key = measurement_key(self.build, sha, [unit_text], workload)
        kept = None if reference else self._stored(key)
        if reference:
            what = f"reference: rung {rung}'s leader again"
        else:
            what = f"rung {rung}" + ("" if block is None else f", interleaved block {block + 1} of 2")
        if kept is not None:
            self.say(f"{what}: {c.label()}: measured before with the same inputs")
            return replace(Measured.of_level(c, rung, kept, self.opts.objective, reused=True), block=block)
        self.say(f"{what}: {c.label()}: serving on port {self.port}")
        self.check_live(f"before {c.key()} rung {rung}")
        started = time.monotonic()
        try:
            failed = self.scratch.start(cand)
            if failed:
                level: dict[str, Any] = {"error": f"the server did not come up: {failed}"}
            else:
                kind = engine(cand.recipe.backend).server
                level = measure_level(self.host, self.port, kind, conc, g, api_key_for(self.host, cand.recipe))
        finally:
            self.scratch.stop(cand)
        self.check_live(f"after {c.key()} rung {rung}")
        self._keep(key, c, rung, level, time.monotonic() - started)
        return replace(Measured.of_level(c, rung, level, self.opts.objective), block=block)

    def _unit_text(self, cand: LoadedRecipe) -> str:
        """The scratch unit as rendered: its command line is part of what a measurement is of."""
        files = planned_service_files(cand, self.scratch.layout)
        return files[0].text

    def _stored(self, key: str) -> dict[str, Any] | None:
        """A measurement kept with the same inputs that may be reused (:func:`kept_level`); None,
        saying why when one was kept but cannot be."""
        if not self.store.exists() or self.opts.remeasure:
            return None
        level, why = kept_level(
            stored_rows(self.store), key, self.provenance, datetime.now(timezone.utc), self.opts.max_age_days
        )
        if why:
            self.say(f"a measurement with the same inputs is kept, but {why}: measuring again")
        return level

    def _keep(self, key: str, c: Candidate, rung: int, level: dict[str, Any], took_s: float) -> None:
        row = {
            "took_s": round(took_s, 1),  # deploy, warm-up and requests: what tune --dry-run predicts with
            "key": key,
            "candidate": c.__dict__,
            "rung": rung,
            "level": level,
            "at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "provenance": self.provenance.as_dict(),
        }
        keep_row(self.store, row)

    # -- the run -------------------------------------------------------------------------------

    def run(self, take_over_stop: Callable[[], None], restore: Callable[[], None]) -> Outcome:
        r = self.loaded.recipe
        current = build_facts.parse_readlink(
            read_fact(self.host, build_facts.readlink_command(f"{self.prefix}/llama.cpp/current"))
        )
        self.build = (current or "").rstrip("/").rsplit("/", 1)[-1]
        if get_gpu(r.gpu).is_cpu:
            # the bench's own probe python: the figure is stored and the bench reuses it
            self.bandwidth = host_membw(self.host, self.prefix, host_python(self.host, self.prefix))["gb_s"]
        # after the bandwidth fact: its time of measurement is one of the facts
        self.provenance = parse_provenance(read_fact(self.host, provenance_command(self.prefix)))
        space = search_space(self.loaded, self.opts, self.bandwidth)
        out = Outcome(space)
        self.say(self.noise.line)
        if not space.survivors:
            raise VoltaforgeError(f"{self.host.name}: {space.why_empty()}")
        # each measurement's cost from its candidate's plan, learned from as they are made
        budget = Budget(self.opts.budget_s, plan_costs(space.survivors, self.loaded.recipe.gate, self.opts.objective))
        too_small = budget.refusal(space.survivors[0].candidate)
        if too_small:
            raise VoltaforgeError(f"{self.host.name}: {too_small}")
        live = self.live_services()
        crowded = self.fits_beside(space, live)
        out.live = {"services": [d.service for d in live]}
        if crowded and not self.opts.take_over:
            raise VoltaforgeError(f"{self.host.name}: {crowded}")
        try:
            if crowded:
                self.say(f"taking over: stopping {', '.join(d.service for d in live)} for the search")
                self.took_over = True  # before the stop: a Ctrl-C amid it must still restore
                take_over_stop()
            # the budget is the search's: the facts above (a first membw probe) are not in it,
            # and neither are the quants the candidates need, made first (each can take longer
            # than a candidate's whole measurement on a large model)
            out.quants_s = self.make_quants(space)
            out.budget = budget
            out.budget.start()
            out.measured, out.ran_out = successive_halving(
                space.survivors,
                self.measure,
                self.opts.rungs,
                out.budget,
                reference=lambda c, rung: self.measure(c, rung, reference=True),
            )
            pair = None if out.ran_out else contenders(out.measured, self.noise.rsd, self.noise.df)
            if pair:
                # the two the figures measured apart cannot tell apart, again in one window
                top = max(m.rung for m in out.measured if m.block is None and not m.reference)
                self.say(f"interleaving {pair[0].label()} and {pair[1].label()} (A B B A): drift cancels")
                out.blocks = interleave(pair, lambda c, i: self.measure(c, top, i), out.budget, top)
                finals = [combined([b for b in out.blocks if b.candidate == c]) for c in pair]
                out.measured += [m for m in finals if m is not None]
                out.ran_out = len(out.blocks) < 4
        finally:
            self.scratch.remove()
            if self.took_over:
                self.say("deploying the live service again")
                restore()
        out.live |= {"taken_over": self.took_over, "checks": self.live_checks}
        out.verdict = choose(out.measured, space.survivors, self.noise.rsd, self.noise.block, self.noise.df)
        self.finish(out)
        return out

    def finish(self, out: Outcome) -> None:
        """The winner as a recipe, and the reports (JSON, Markdown, chart) of every candidate."""
        r = self.loaded.recipe
        at = stamp()
        verdict = out.verdict
        if verdict and verdict.winner:
            o = self.opts
            how = f"--host {self.host.name} --recipe {r.name} --objective {o.objective}, {at}: {verdict.why}"
            name = f"{r.name}-tuned"
            text = winner_recipe_text(self.loaded, verdict.winner, how, name)
            out.winner_recipe = write_winner(text, name, o.recipes_dir)
        table = tune_report.rows(out.measured, out.space.survivors, verdict, self.kld)
        out.result = tune_report.result(
            self.host.name,
            r.name,
            self.opts.objective,
            out.space,
            table,
            verdict,
            out.ran_out,
            out.live,
            str(out.winner_recipe) if out.winner_recipe else None,
            at,
            None if out.budget is None else {**out.budget.as_dict(), "quants_s": round(out.quants_s, 1)},
            interleaved(out.blocks),
            rung_drift(out.measured),
        )
        # what every comparison of the search counted between runs, and where it came from
        out.result["run_noise"] = {
            "rsd": self.noise.rsd,
            "block": self.noise.block,
            "df": self.noise.df,
            "source": self.noise.line,
        }
        out.report_dir = self.root / at.replace(":", "")
        tune_report.write(out.result, out.report_dir)


def search_space(loaded: LoadedRecipe, opts: TuneOptions, bandwidth_gb_s: float | None = None) -> Space:
    """The candidates the levers make, planned and pruned, in measuring order (pure: what a
    run measures and what ``tune --dry-run`` shows are one list)."""
    lv = opts.levers
    base = base_candidate(loaded)
    # levers not named: the recipe's cache and an f16 one, the recipe's -ub and 64 (sm_70's
    # MMQ kernels run only below 64-token batches, so -ub around 64 switches kernels)
    caches = lv.caches or tuple(dict.fromkeys([(base.cache_k, base.cache_v), ("f16", "f16")]))
    ubatches = lv.ubatches or tuple(dict.fromkeys([base.ubatch, 64]))
    cands = enumerate_space(base, lv.quants, caches, lv.flash_attn, lv.slots, ubatches, lv.spec_types, lv.threads)
    return prune(loaded, cands, opts.objective, opts.min_ctx, opts.min_bpw, bandwidth_gb_s)


# ------------------------------------------------------------------------------------------
# the winner as a recipe
# ------------------------------------------------------------------------------------------


def stamp() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class TuneInterrupted(VoltaforgeError):
    """Ctrl-C during a search: the conductor's finally blocks have run; the message says what
    they left (exit 130, as a shell reports SIGINT)."""

    exit_code = 130


def tune_host(
    settings: Settings,
    host_name: str,
    recipe: str | None,
    opts: TuneOptions,
    say: Callable[[str, str], None],
    printer: Printer | None = None,
) -> Outcome:
    """One tune run on one host from the inventory: connect, take the host lock, search (the
    live services stopped and restored around it when --take-over needs it)."""
    spec = settings.host_spec(host_name)
    named = recipe or spec.recipe
    # a named recipe is loaded before any host is reached: a bad name is one line, nothing touched
    preloaded = settings.load_recipe(named) if named else None
    with settings.connect(spec, printer) as host:
        loaded = preloaded or settings.load_recipe(settings.recipe_for(host_name, None, host))
        sudo = not parse_writable(host.run(writable_command(spec.prefix), check=False, stream=False).stdout)
        tuner = Tuner(host, spec.prefix, loaded, opts, scratch_ops(), say=lambda line: say(host.name, line))
        # what the live services are, from the same read the search checks them by: each
        # stopped by its own unit, each recipe deployed again as the host serves it (a layout:
        # its GPUs, port and units)
        live = [d for d in tuner.live_services() if d.recipe is not None]
        layout = {s.name: s for s in host_serves(spec, None, settings.load_recipe)} if spec.serve else {}
        again: dict[str, Served] = {}
        for d in live:
            assert d.recipe is not None
            lr = load_recipe(recipe_file(d.recipe, f"{host.name}:{d.service}"))
            again.setdefault(lr.recipe.name, layout.get(lr.recipe.name) or Served(lr))

        def take_over() -> None:
            for d in live:
                mgr = deployment_manager(host, spec.prefix, d)
                if mgr is not None:
                    run_command(host, mgr.stop())

        def restore() -> None:
            for s in again.values():
                run_ops(host, deploy_ops(s.loaded, host, spec.prefix, "auto", s.gpus, server=s.layout(spec.prefix)))

        with host_lock(host, spec.prefix, sudo=sudo):
            try:
                return tuner.run(take_over, restore)
            except KeyboardInterrupt:
                state = "deployed again" if tuner.took_over else "untouched" if live else "none was running"
                raise TuneInterrupted(
                    f"interrupted: the scratch server was stopped and removed; the live service: {state}; "
                    "every measurement finished so far is kept (a re-run resumes)"
                ) from None


def interleaved(blocks: Sequence[Measured]) -> dict[str, Any] | None:
    """The report's account of the final window: each block in order, and the drift seen."""
    if not blocks:
        return None
    moved = drift(blocks)
    return {
        "order": [{"candidate": b.candidate.label(), "block": (b.block or 0) + 1, "figure": b.figure} for b in blocks],
        "drift_pct": None if moved is None else round(moved * 100, 2),
    }
