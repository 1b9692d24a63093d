"""Errors that reach the user as one line (the CLI prints them and exits with status 2)."""


class MoebenchError(Exception):
    """Bad input or an impossible request. The message says what is wrong and what to do."""


class FormatMismatchError(MoebenchError):
    """A prepare/finalize and an experts backend disagree on the activation format."""


class UnsupportedError(MoebenchError):
    """A backend cannot run here (package missing, wrong device, too few GPUs...)."""
