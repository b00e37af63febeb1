"""The rank state's one error type."""


class StateError(RuntimeError):
    """An op that cannot run on this rank's state; the message names rank, op and cause."""
