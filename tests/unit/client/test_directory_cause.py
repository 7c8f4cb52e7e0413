"""One error -> cause mapping for the client's directory calls (issue 26): lookups and saves
count a failed call under the same cause, except that a lookup names any other error
`directory_error` where a save names it by its wire code."""

from __future__ import annotations

import pytest

from kvfabric.client.aio import directory_cause
from kvfabric.format.errors import (
    Busy,
    Indeterminate,
    KvfError,
    NoCapacity,
    RateLimited,
    StaleGeneration,
    Unavailable,
    WrongShard,
)


@pytest.mark.parametrize(
    ("error", "cause"),
    [
        (StaleGeneration("epoch", 1, 2), "directory_stale_epoch"),
        (Unavailable("no responders"), "directory_unavailable"),
        (WrongShard("moved"), "directory_unavailable"),
        (Indeterminate("timeout"), "directory_timeout"),
        (TimeoutError(), "directory_timeout"),
        (RateLimited("tenant rate", retry_after_ms=10), "rate_limited"),
    ],
)
def test_lookups_and_saves_share_the_named_causes(error: KvfError | TimeoutError, cause: str) -> None:
    assert directory_cause(error) == cause
    assert directory_cause(error, other="directory_error") == cause


@pytest.mark.parametrize("error", [Busy("full"), NoCapacity("full"), KvfError("bug")])
def test_any_other_error_is_its_wire_code_or_the_callers_name(error: KvfError) -> None:
    assert directory_cause(error) == error.code
    assert directory_cause(error, other="directory_error") == "directory_error"
