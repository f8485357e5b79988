"""The daemon's storage tiers and the error every integrity check raises.

L1 (GPU) lives in the engines; the daemon only knows L2 (shared pinned host memory) and
L3 (the local slot file). The enum values are the tier numbers so they read naturally in
logs and status ("l2", "l3").
"""

from __future__ import annotations

import enum


class Tier(enum.IntEnum):
    L2 = 2
    L3 = 3

    @property
    def label(self) -> str:
        return f"l{int(self)}"


class IntegrityError(Exception):
    """A stateful structure found its own invariants broken (a bug, never bad peer input)."""
