"""User-facing errors.

Every failure a user can cause (bad recipe, unknown GPU, unreachable host, ...) is raised as a
VoltaforgeError whose message says what is wrong and where, in one or a few lines. The CLI
prints the message and exits non-zero; it never shows a traceback for these.
"""


class VoltaforgeError(Exception):
    """An error caused by input or environment, with a message meant for the user."""

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class UsageError(VoltaforgeError):
    """A flag has a value the command cannot use."""


class RecipeError(VoltaforgeError):
    """A recipe (or model config, or inventory) file is invalid."""


class HostError(VoltaforgeError):
    """A host cannot be reached, authenticated, or operated on."""
