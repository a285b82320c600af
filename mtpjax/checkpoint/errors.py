"""The one error type of checkpoint reading and writing.

A `CheckpointError` names what is wrong (the tensor, the file, the config key) so that a damaged
or unsupported checkpoint can be fixed without a debugger. It is a `ValueError`, so callers that
report bad input (the CLI) catch it with everything else the library rejects.
"""


class CheckpointError(ValueError):
    pass
