"""Error types for user mistakes: the CLI prints their message and exits with code 2, no traceback."""


class UserError(Exception):
    """A mistake the user can fix (bad config, bad input file). Message must say what to do."""

    exit_code = 2


class ConfigError(UserError):
    """A configuration key is unknown, has the wrong type, or an invalid value."""


class DataError(UserError):
    """Input data cannot be read or is malformed (message names file:line where possible)."""


def json_type(value) -> str:
    """What a parsed JSON value is, in words (``a list``, ``a string``, ...), for the messages that refuse a file."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return names.get(type(value), "null")
