"""User-facing errors: one clear line, no traceback."""


class StagemeshError(Exception):
    """An error caused by the user's input or environment.

    The command line prints ``str(err)`` as one line and exits 2; services map
    it to INVALID_ARGUMENT / FAILED_PRECONDITION instead of INTERNAL.
    """
