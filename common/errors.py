"""The errors the core raises (the harness's own are in harness.errors). Each is raised with a message that names the
file and line, the field or the flag at fault; harness.cli.one_line_errors prints it as one line and exits with 1."""


class UserError(Exception):
    """An error on the user's side (bad data or flags, a missing file, a stopped run): its message is all they need."""


class DataError(UserError, ValueError):
    """A problem in the user's data; the message names the file and line (or index) of each bad row."""


class ModelError(UserError, ValueError):
    """A --model / --adapter that is not what it must be: no such path, no config.json, an adapter of another base."""


class ArgsError(UserError, ValueError):
    """A flag whose value cannot work; raised before any weights load."""


class RewardError(UserError, RuntimeError):
    """A reward function returned what cannot train (NaN, Inf, a non-number): the message names the function."""
