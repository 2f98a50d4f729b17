"""The one exception every layer raises for what the user can fix. A leaf: it imports nothing."""


class UserError(Exception):
    """Something the user can fix; the CLI prints it as one line, without a traceback."""
