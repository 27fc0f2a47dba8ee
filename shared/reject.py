"""The seven prompt-cache reject reasons, in their fixed order (spec: prompt-cache.md).

One type for the store, the scheduler, the publisher, the router's merge and Prometheus labels.
"""

from __future__ import annotations

import enum


class RejectReason(enum.StrEnum):
    OVERSIZED = "oversized"
    DISABLED = "disabled"
    PREFIX_TOO_SHORT = "prefix_too_short"
    MODE_MISMATCH = "mode_mismatch"
    EMPTY_SET = "empty_set"
    LAYOUT_CONSTRAINTS = "layout_constraints"
    BLOCK_BOUNDARY_FLOOR = "block_boundary_floor"

    @property
    def stats_field(self) -> str:
        """The `/v1/cache/stats` (and Redis hash) field counting this reason."""
        return f"reject_{self.value}"


# Fixed order: dashboards and the stats JSON list them this way.
REJECT_REASONS: tuple[RejectReason, ...] = tuple(RejectReason)
