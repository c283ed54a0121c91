"""Host facts: a command to run plus a pure parser of its output (pyinfra style)."""


def read_fact(host, command: str) -> str:
    """Run a fact's read-only command quietly; its parser judges the output, even on failure."""
    return host.run(command, check=False, stream=False).stdout
