"""The error types of the kernels, and the base error every bitnet-cpu error derives from.

They live here, at the bottom of the house, so that simd imports nothing of the engine; engine/errors.py
re-exports them beside the engine's own errors. The CLI prints `str(err)` as one line and exits with
`err.exit_code`: EXIT_BAD_INPUT for everything the user can act on, EXIT_BUG for a KernelError (an engine
bug: the message says so and asks for a report).
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


class KernelError(BitNetError, ValueError):
    """A kernel was called with arguments that break its preconditions (raised at the Cython boundary).
    The engine checks every input before it reaches a kernel, so this is a bug of the engine, not the user's:
    the CLI says so (BUG_REPORT_HINT) and exits EXIT_BUG."""

    exit_code = EXIT_BUG


class IsaChoiceError(KernelError):
    """BITNET_ISA / set_isa() named a kernel path that does not exist or this CPU cannot run: the user's
    choice, so an ordinary bad-input error (still a KernelError for callers that catch those)."""

    exit_code = EXIT_BAD_INPUT
