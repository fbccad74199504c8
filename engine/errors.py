"""Typed errors of the engine. The CLI prints `str(err)` as one line (plus the hint) and exits 2.

Every message names the file or flag and says what is wrong; `hint` says what to do.
"""


class BitNetError(Exception):
    """Base class: a problem the user can act on (never a bug in the engine)."""

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint

    def __str__(self) -> str:  # one line
        msg = super().__str__()
        return f"{msg} (hint: {self.hint})" if self.hint else msg


class FormatError(BitNetError):
    """A model file is corrupt, truncated, or not what it claims to be."""


class UnsupportedError(BitNetError):
    """A well-formed file uses something we do not support (architecture, tensor type, ...)."""


class ContextOverflowError(BitNetError):
    """The prompt (plus what is asked to be generated) does not fit the context window."""


class KernelError(BitNetError, ValueError):
    """A kernel was called with arguments that break its preconditions (raised at the Cython boundary)."""


class QueueFullError(BitNetError):
    """The batching engine already has max_queue requests waiting (the server answers 503 / 429)."""
