"""The errors the harness raises (a missing hub input, an output dir that cannot take a run, a resume that would not
continue this run, a checkpoint that fails its hashes, a stop before the last step): common.errors.UserError's, so
harness.cli.one_line_errors prints each as one line."""

from common.errors import UserError


class HubUnavailable(UserError, OSError):
    """The hub cannot be reached (or HF_HUB_OFFLINE is set) and what the run needs from it is not in the cache."""


class OutputDirError(UserError, RuntimeError):
    """The output directory cannot take a run (read-only, full, not a directory)."""


class ResumeError(UserError, ValueError):
    """A resume that would not continue this run: another experiment's checkpoint, or no steps left."""


class CorruptCheckpointError(UserError, RuntimeError):
    """A checkpoint whose files or tensors do not match the hashes recorded when it was written."""


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
