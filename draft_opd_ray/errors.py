"""Errors users see. Each names the offending key or file and what is allowed, so a bad run
fails in seconds with one readable line instead of a traceback deep inside a Ray actor."""


class DraftOPDError(ValueError):
    """Base class for user-facing errors (bad config, bad data, bad model folder)."""


class ConfigError(DraftOPDError):
    """A config value is invalid. The message starts with the dotted key."""


class DataError(DraftOPDError):
    """A prompt file or prompt set is unusable (missing, empty, malformed)."""


class ModelError(DraftOPDError):
    """A target or draft model folder is missing or does not match the other model."""


class RefitError(DraftOPDError):
    """A receiver does not serve the draft weights just published (wrong version or different values)."""


class ClusterError(DraftOPDError):
    """The Ray cluster cannot run the plan: unreachable, too small, or its storage is not shared."""


class CheckpointError(DraftOPDError):
    """A run dir's checkpoint is missing, incomplete or holds something other than tensors and plain data."""


class RunError(Exception):
    """The run cannot go on for a reason that is not bad input (diverged, an actor lost for good, a hang): one
    line naming what failed and what was kept; exit code 1."""
