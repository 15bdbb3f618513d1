"""Structured, rate-limited logs on the ``nsa`` logger (NSA_DEBUG_LOG, NSA_DEBUG_LOG_LIMIT).

A record is one line ``<tag> key=value key=value``: easy to grep in a runner's logs. Each tag is
emitted at most ``NSA_DEBUG_LOG_LIMIT`` times per process so a hot path cannot flood the output.
Fallback notices go through :func:`log_once`, which speaks whether or not NSA_DEBUG_LOG is set,
because a silent fallback is a defect.
"""

from __future__ import annotations

import logging
from collections import Counter

from nsa_core.toggles import get_toggles

logger = logging.getLogger("nsa")

_emitted: Counter[str] = Counter()
_once: set[str] = set()
_debug_once: set[str] = set()


def _format(tag: str, fields: dict[str, object]) -> str:
    return " ".join([tag, *(f"{key}={value}" for key, value in fields.items())])


def debug_log(tag: str, **fields: object) -> None:
    """Log ``tag`` with ``fields`` when NSA_DEBUG_LOG is on, at most NSA_DEBUG_LOG_LIMIT times."""
    toggles = get_toggles()
    if not toggles.debug_log or _emitted[tag] >= toggles.debug_log_limit:
        return
    _emitted[tag] += 1
    logger.info(_format(tag, fields))


def debug_log_once(key: str, tag: str, **fields: object) -> None:
    """:func:`debug_log` at most once per ``key`` (a device, say) while NSA_DEBUG_LOG is on.

    ``key`` counts as seen only when the line was logged: a call made with the log off must not
    silence the line for a later call made with it on.
    """
    if key in _debug_once or not get_toggles().debug_log:
        return
    _debug_once.add(key)
    debug_log(tag, **fields)


def log_once(key: str, tag: str, **fields: object) -> bool:
    """Log ``tag`` once per ``key`` at WARNING (always on); True when it was logged now."""
    if key in _once:
        return False
    _once.add(key)
    logger.warning(_format(tag, fields))
    return True


def reset_log_state() -> None:
    """Forget which tags were emitted (tests)."""
    _emitted.clear()
    _once.clear()
    _debug_once.clear()
