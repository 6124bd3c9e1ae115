"""Stop strings, matched on detokenized text: text is held back until it cannot start a stop."""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        # Up to this many trailing characters may be the start of a stop string.
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._pending = ""
        # The stop string that ended generation, once one has.
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        """New text in; (text safe to emit, whether a stop string was hit) out."""
        if not self.stops:
            return text, False
        self._pending += text
        hits = [(i, s) for s, i in ((s, self._pending.find(s)) for s in self.stops) if i >= 0]
        if hits:
            first, self.matched = min(hits)
            emit, self._pending = self._pending[:first], ""
            return emit, True
        cut = max(len(self._pending) - self._hold, 0)
        emit, self._pending = self._pending[:cut], self._pending[cut:]
        return emit, False

    def flush(self) -> str:
        """What was held back, once generation ended without a stop string."""
        rest, self._pending = self._pending, ""
        return rest
