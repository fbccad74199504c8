"""Typed errors of the engine and the exit codes of the `bitnet` and `bitchat` commands.

The CLI prints `str(err)` as one line (plus the hint) and exits with `err.exit_code`: EXIT_BAD_INPUT for
everything the user can act on, EXIT_BUG for a KernelError (an engine bug: the message says so and asks
for a report). Every message names the file or flag and says what is wrong; `hint` says what to do.
"""

EXIT_OK = 0
EXIT_BAD_INPUT = 2      # a flag, a prompt or a model file is wrong (also: the file changed while in use)
EXIT_BUG = 70           # an internal error of bitnet-cpu (EX_SOFTWARE): please report it
EXIT_INTERRUPTED = 130  # Ctrl-C
BUG_REPORT_HINT = "this is a bug in bitnet-cpu, not in your input: please report it with the command you ran"


class BitNetError(Exception):
    """Base class: a problem the user can act on (never a bug in the engine)."""

    exit_code = EXIT_BAD_INPUT

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
    """A kernel was called with arguments that break its preconditions (raised at the Cython boundary).
    The engine checks every input before it reaches a kernel, so this is a bug of the engine, not the user's:
    the CLI says so (BUG_REPORT_HINT) and exits EXIT_BUG."""

    exit_code = EXIT_BUG


class IsaChoiceError(KernelError):
    """BITNET_ISA / set_isa() named a kernel path that does not exist or this CPU cannot run: the user's
    choice, so an ordinary bad-input error (still a KernelError for callers that catch those)."""

    exit_code = EXIT_BAD_INPUT


class QueueFullError(BitNetError):
    """The batching engine already has max_queue requests waiting (the server answers 503 / 429)."""
