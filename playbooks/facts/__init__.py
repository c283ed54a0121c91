"""Host facts: a command to run plus a pure parser of its output (pyinfra style)."""
