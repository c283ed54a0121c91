"""Measuring: the benchmark (its arithmetic, client, run, reports, statistics), the gate, and the
search `invoke tune` runs over configurations."""
