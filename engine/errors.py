"""Typed errors of the engine and the exit codes of the `bitnet` and `bitchat` commands.

The CLI prints `str(err)` as one line (plus the hint) and exits with `err.exit_code`: EXIT_BAD_INPUT for
everything the user can act on, EXIT_BUG for a KernelError (an engine bug: the message says so and asks
for a report). Every message names the file or flag and says what is wrong; `hint` says what to do.
"""

import signal

from ..simd.errors import (  # noqa: F401  (the base error and the kernels' errors live at the bottom: simd)
    BUG_REPORT_HINT,
    EXIT_BAD_INPUT,
    EXIT_BUG,
    EXIT_INTERRUPTED,
    EXIT_OK,
    BitNetError,
    IsaChoiceError,
    KernelError,
)


class Terminated(SystemExit):
    """SIGTERM / SIGHUP (a service stopped, the terminal closed): the commands raise it from the signal, so a
    command unwinds as on Ctrl-C (temporary files removed, the terminal restored, bitchat's answer so far kept)
    and exits 128 + signum, where the signal's default action killed it mid-write.

    A SystemExit (its code 128 + signum), because asyncio lets only SystemExit and KeyboardInterrupt out of an
    event-loop callback: raised while bitchat's prompt (prompt_toolkit's loop) read a line, any other exception
    went to the loop's handler, which printed "Unhandled exception in event loop ... Press ENTER to continue"
    and bitchat went on as if the signal had never come."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum


ENDING_SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None)) if s is not None)


def raise_terminated(signum, frame):
    """The SIGTERM / SIGHUP handler the commands put in place (`signal.signal(s, raise_terminated)` for each of
    ENDING_SIGNALS): the command unwinds from wherever it is, as on Ctrl-C."""
    raise Terminated(signum)


def write_failed(e: BaseException) -> bool:
    """An OSError of a write the machine refused (a full disk or quota, a file over its size limit, an I/O error):
    its state, said in one line (`bitnet: error: write error: No space left on device`, as coreutils says it),
    never reported as a bug. A closed pipe is not one (it ends quietly)."""
    import errno
    return (isinstance(e, OSError) and not isinstance(e, BrokenPipeError)
            and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO))


def write_error_line(prog: str, e: OSError) -> str:
    where = f" ({e.filename})" if getattr(e, "filename", None) else ""
    return f"{prog}: error: write error{where}: {e.strerror or e}"


class FormatError(BitNetError):
    """A model file is corrupt, truncated, or not what it claims to be."""


class ModelChangedError(BitNetError):
    """A model file was rewritten in place (`cp` over it, `rsync --inplace`) while it was loaded from its mapping:
    what the engine would read now is another file's bytes through the old index. Load the model again."""


class UnsupportedError(BitNetError):
    """A well-formed file uses something we do not support (architecture, tensor type, ...)."""


class ContextOverflowError(BitNetError):
    """The prompt (plus what is asked to be generated) does not fit the context window. n_prompt_tokens / n_ctx:
    the counts, where the raiser knows them (llama-server's error carries them; its web UI shows them)."""

    def __init__(self, message: str, *, hint: str | None = None, n_prompt_tokens: int | None = None,
                 n_ctx: int | None = None):
        super().__init__(message, hint=hint)
        self.n_prompt_tokens, self.n_ctx = n_prompt_tokens, n_ctx


class QueueFullError(BitNetError):
    """The batching engine already has max_queue requests waiting (the server answers 503 / 429)."""


class ConstraintError(BitNetError):
    """A schema, regex or grammar that cannot be enforced exactly (syntax error, unsupported keyword, too large
    or too slow to compile). `where` names the field or flag it came from ("response_format", "--grammar")."""

    def __init__(self, message: str, hint: str | None = None, *, where: str = "constraint"):
        super().__init__(message, hint)
        self.where = where


class GrammarBusyError(QueueFullError):
    """Every compile slot of the grammar engine stayed taken (by other requests' schemas or grammars) for as long
    as a request may wait for one: the server is busy, the spec is not at fault (a server answers 503, to retry)."""


def json_text(value, limit: int = 80) -> str:
    """A request's value as JSON spells it (true, null, double quotes, arrays: not Python's True, None, 'x',
    tuples), cut at `limit` characters (an image's base64 is not echoed back whole)."""
    import json
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[:limit] + "..."


def shown_value(value, json_terms: bool = False) -> str:
    """A bad value as a message echoes it: JSON's spelling for a JSON API's client (json_terms), else Python's
    repr (a Python caller's True, None, 'x')."""
    return json_text(value) if json_terms else repr(value)


def quoted(value, limit: int = 80) -> str:
    """repr(value) for a message, cut at `limit` characters: a name, key or value read from a model file, which
    a corrupt header can make as long as the file (a line of megabytes, printed to a terminal or a server log)."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return text[:limit] + "..." + (f" ({len(value)} characters)" if isinstance(value, str) else "")


def shown_number(value) -> str:
    """A number as a message echoes it: every digit of Python's repr (2.0000001, which {:g} rounded to a 2 that
    is in range), a whole float without repr's ".0" (5, as a client or a flag writes it)."""
    if isinstance(value, float):
        text = repr(float(value))   # numpy's float64 too (its own repr is np.float64(...))
        return text[:-2] if text.endswith(".0") else text
    return str(value)


def json_why(e: BaseException) -> str:
    """What a JSON parse error says, in one phrase: a RecursionError (json nests by recursion, so a document
    nested a few thousand levels deep exhausts the stack) is "nested too deeply", not Python's own words."""
    return "nested too deeply" if isinstance(e, RecursionError) else str(e)


def token_ids(ids, what: str = "prompt", text_ok: bool = True) -> list[int]:
    """ids (a sequence of token ids: ints, numpy integers) as a list of int; BitNetError naming `what` for anything
    else (None, a number, a float or bool id, a string of digits), which raised a bare TypeError or ValueError, or
    was taken (1.5 and True as id 1)."""
    if ids is None or isinstance(ids, (str, bytes, bytearray)) or not hasattr(ids, "__iter__"):
        raise BitNetError(f"{what}: give {'text (str) or ' if text_ok else ''}token ids, not {type(ids).__name__}")
    out = []
    for t in ids:
        if isinstance(t, bool) or not hasattr(t, "__index__"):
            raise BitNetError(f"{what}: token ids are integers, not {type(t).__name__} ({t!r})")
        out.append(t.__index__())
    return out
