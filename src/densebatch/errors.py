"""Error types for user mistakes: the CLI prints their message and exits with code 2, no traceback."""

import json
from pathlib import Path


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


def read_json_object(path, what: str) -> dict:
    """The JSON object in the file ``path``; ``ConfigError`` in one line when it is not valid JSON (UTF-8) or
    not an object: "``path`` is not ``what``: ..." (a saved file the user edited, or damage)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise ConfigError(f"{path} is not {what}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not {what}: expected a JSON object; got {json_type(data)}")
    return data
