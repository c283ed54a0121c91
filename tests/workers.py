"""How the suite shares pytest-xdist's workers (``invoke test`` runs two on this 2-core machine).

Most real tests spend their time waiting: on a server to load, a container to boot, an SSH
round trip, a pip run inside a container. A second worker fills that time with the tests
beside them, so the suite is spread with ``--dist loadgroup``: every test goes to whichever
worker is free, except the tests of one group below, which run on one worker in file order.

A test is put in a group only when it depends on another test having run first in the same
process order; everything else must stand alone (its own ports, tmp_path, prefix and test
user: tests/testhosts.py names everything it creates per process, and the caches it builds
take a file lock, so two workers wanting the static llama.cpp tools build it once).

``llamacpp-ccache``: the first of them compiles llama.cpp's server through the build step over
SSH (test_build), into the run's shared ccache (tests/helpers.session_ccache); the others
compile the same objects again on other hosts (seeded into the containers' ccache) and are
cheap only after it. On two workers their order would be chance; in one group it is the file
order, as in a serial run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

GROUPS = {
    "test_build.py": "llamacpp-ccache",
    "test_layout_real.py": "llamacpp-ccache",
    "test_provision_real.py": "llamacpp-ccache",
    "test_quantize_real.py": "llamacpp-ccache",
    "test_rpc_split_real.py": "llamacpp-ccache",
}


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        group = GROUPS.get(Path(str(item.fspath)).name)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
