"""The base class of every failure the user can fix.

`fab` ends a task that raises one with its message on one line and no traceback
(ops/actions/cluster_task.py), so each message names the setting or step and the fix.
"""


class UserError(Exception):
    """A known failure whose message tells the user what to change."""
