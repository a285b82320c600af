"""The one error type of checkpoint reading and writing.

A `CheckpointError` names what is wrong (the tensor, the file, the config key) so that a damaged
or unsupported checkpoint can be fixed without a debugger. It is a `ValueError`, so callers that
report bad input (the CLI) catch it with everything else the library rejects.
"""


import json


class CheckpointError(ValueError):
    pass


def json_object(data: bytes, where: str, expected: str = "a JSON object") -> dict:
    """`data` (a JSON file's bytes) parsed as an object; a CheckpointError naming `where` (the
    file) otherwise: not UTF-8 / not JSON, or "expected {expected}, got a list" etc."""
    try:
        value = json.loads(data.decode("utf-8"))
    except ValueError as e:              # UnicodeDecodeError and JSONDecodeError alike
        raise CheckpointError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{where}: expected {expected}, got a {type(value).__name__}")
    return value
