"""voltaforge: plan, provision and benchmark LLM serving on NVIDIA V100 (sm_70) hosts.

The package is split the way provisioning code is best split: pure logic (planning, recipe
validation, fact parsing, command building) with no I/O, and a thin I/O edge (hosts, tasks).
"""

__version__ = "0.1.0"
