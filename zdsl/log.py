"""Logging: structlog to stderr, configured once per process, with the rank bound in ranks."""
from __future__ import annotations

import logging
import sys

_logging_configured = False


class _CurrentStderr:
    """Whatever ``sys.stderr`` is when an event is written (it may be replaced after configuration:
    pytest's capture, a redirect), so logging never writes to a closed stream."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(rank: int | None = None, level: str = "warning") -> None:
    """Configure structlog once per process (again only to bind a rank); events go to stderr."""
    global _logging_configured
    import structlog  # only when configured
    lvl = logging.getLevelName(level.upper()) if isinstance(level, str) else int(level)
    if not isinstance(lvl, int):
        lvl = logging.WARNING
    if not _logging_configured or rank is not None:
        structlog.configure(
            processors=[
                structlog.contextvars.merge_contextvars,
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="%H:%M:%S", utc=True),
                structlog.dev.ConsoleRenderer(colors=False),
            ],
            wrapper_class=structlog.make_filtering_bound_logger(lvl),
            # structlog types file as TextIO but calls only write and flush, which this has
            logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),  # type: ignore[arg-type]
            cache_logger_on_first_use=False,
        )
        _logging_configured = True
    if rank is not None:
        structlog.contextvars.bind_contextvars(rank=rank)
