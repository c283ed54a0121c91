"""Steps: what runs against a host (preflight, toolchain, build, ...), each a list of operations."""
