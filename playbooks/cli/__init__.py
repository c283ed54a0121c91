"""The CLI edge: Invoke tasks, flag checking, rendering for people."""
