"""The one exception family for user mistakes (bad config, data, checkpoint or CLI input).

Entry points catch `UserError`, print its one-line message and exit with code 2; any other
exception is a bug and keeps its traceback.
"""


class UserError(ValueError):
    """A mistake the user can fix; `str(err)` names what is wrong, where, and the fix."""


EXIT_USER_ERROR = 2
