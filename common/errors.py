"""The errors a user sees, in one place. Each is raised with a message that names the file and line, the field or
the flag at fault; harness.cli.one_line_errors prints such a message as one line and exits with status 1."""


class UserError(Exception):
    """An error on the user's side (bad data or flags, a missing file, a stopped run): its message is all they need."""


class DataError(UserError, ValueError):
    """A problem in the user's data; the message names the file and line (or index) of each bad row."""


class ModelError(UserError, ValueError):
    """A --model / --adapter that is not what it must be: no such path, no config.json, an adapter of another base."""


class ArgsError(UserError, ValueError):
    """A flag whose value cannot work; raised before any weights load."""


class HubUnavailable(UserError, OSError):
    """The hub cannot be reached (or HF_HUB_OFFLINE is set) and what the run needs from it is not in the cache."""


class OutputDirError(UserError, RuntimeError):
    """The output directory cannot take a run (read-only, full, not a directory)."""


class ResumeError(UserError, ValueError):
    """A resume that would not continue this run: another experiment's checkpoint, or no steps left."""


class CorruptCheckpointError(UserError, RuntimeError):
    """A checkpoint whose files or tensors do not match the hashes recorded when it was written."""


class RewardError(UserError, RuntimeError):
    """A reward function returned what cannot train (NaN, Inf, a non-number): the message names the function."""


class NonFiniteWeightsError(UserError, RuntimeError):
    """Raised instead of saving a model with NaN/Inf weights."""


class RunStopped(UserError, RuntimeError):
    """A run stopped before its last step (a circuit breaker, Ctrl-C), its checkpoint saved and final/ not written.
    requested: the user asked for it (Ctrl-C), which the CLI reports as a stop with an interrupt's status (130)."""

    def __init__(
        self, message: str, step: int, checkpoint: str | None, result: dict | None = None, requested: bool = False
    ):
        super().__init__(message)
        self.step = step
        self.checkpoint = checkpoint
        self.result = result or {}
        self.requested = requested
