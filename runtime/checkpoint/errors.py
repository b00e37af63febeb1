"""The one error a checkpoint operation raises."""


class CheckpointError(Exception):
    """A checkpoint is missing, incomplete or damaged; the message names the file."""
