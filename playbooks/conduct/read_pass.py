"""A run's reads pass: every step checked as a dry run checks it, with every read answered
from batches (host/prefetch.py), so a host with nothing to do is known in one round trip.

The reads the last pass of this host and recipe made (conduct/known_reads.py) are fetched
first; any read a pass still lacks is fetched and the pass run again, up to MAX_READ_PASSES
(one per level of reads that depend on other reads' answers; the known reads make it one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from playbooks.conduct.known_reads import KnownReads
from playbooks.errors import HostError, VoltaforgeError
from playbooks.host import Host
from playbooks.host.output import BufferedPrinter
from playbooks.host.prefetch import NotARead, Reads

MAX_READ_PASSES = 4

Outcome = TypeVar("Outcome")


def read_pass(
    host: Host,
    known: KnownReads,
    fresh: Callable[[], Outcome],
    check: Callable[[BufferedPrinter, Outcome], None],
) -> tuple[Outcome, BufferedPrinter] | None:
    """Run ``check`` (the steps as a probing dry run, into a fresh outcome and printer) with
    the host's reads answered from batches. Returns the checked outcome and its lines, and
    keeps the reads for the next run; None when the reads could not be settled this way (the
    normal run then finds the cause and says it)."""
    reads = Reads()
    buffered = BufferedPrinter()
    printer = host.printer
    host.printer = buffered
    try:
        calls = known.load()
        for _ in range(MAX_READ_PASSES):
            if calls:
                host.fetch_reads(reads, calls)
            reads.new_pass()
            buffered.lines.clear()
            trial = fresh()
            try:
                with host.reading(reads):
                    check(buffered, trial)
            except NotARead:
                return None
            except Exception:
                # a parser given an empty answer for a read not fetched yet; with every read
                # answered it is a real error, which the normal run reports
                if not reads.misses:
                    return None
            calls = list(reads.misses)
            if not calls:
                break
        else:
            return None
    except (HostError, VoltaforgeError):
        return None  # the batch itself failed: the normal run meets the cause and says it
    finally:
        host.printer = printer
    known.save(reads.asked)
    return trial, buffered
