"""The unread window every integration asks the daemon for, in one place."""

from __future__ import annotations


def unread_window_ms(key: str, seconds: object) -> int | None:
    """``seconds`` (a config value; 0: no window) as the daemon's ``unread_release_ms``.

    A publication no reader claims (a cache publication: reads) for that long
    is released unread by the daemon; ``None`` keeps it until its writer or an
    operator releases it. ``key`` names the setting in the error."""
    try:
        s = float(seconds)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{key} is a number of seconds (0: keep every publication), not {seconds!r}") from None
    if not s >= 0:
        raise ValueError(f"{key} is a number of seconds (0: keep every publication), not {s}")
    return max(1, round(s * 1000)) if s > 0 else None
