"""One exception type for every user-facing failure.

The CLI prints `error: <message>` and exits 1; the message is one line and names the file,
tensor or field at fault, so a user can act on it without a traceback.
"""


class DFlashError(Exception):
    """A user-facing error: bad input, missing file, impossible request."""
