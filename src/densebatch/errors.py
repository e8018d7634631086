"""Error types for user mistakes: the CLI prints their message and exits with code 2, no traceback."""


class UserError(Exception):
    """A mistake the user can fix (bad config, bad input file). Message must say what to do."""

    exit_code = 2


class ConfigError(UserError):
    """A configuration key is unknown, has the wrong type, or an invalid value."""


class DataError(UserError):
    """Input data cannot be read or is malformed (message names file:line where possible)."""
