"""The one error type of the data package.

A bad dataset row or tokenizer path is a user's mistake, not a bug: it raises
`DataError`, a `UserError` (a ValueError), so the CLI prints it as one line with
exit code 2. Each message names the file, the row and the fix.
"""

from megatron_dapo.errors import UserError


class DataError(UserError):
    """A dataset file or tokenizer the user pointed at cannot be used as given."""
