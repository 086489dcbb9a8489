"""The one error type the command line turns into a one-line message."""


class CliError(Exception):
    """A user error: printed as one line, exit status 2."""
