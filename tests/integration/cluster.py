"""The local test cluster: it lives in `kvfabric.testing.cluster` (bench/ and tools/ use it too, and
nothing imports tests); re-exported here for the test modules."""

from kvfabric.testing.cluster import (
    LIST_PAGES_MAX,
    SECRET,
    TEST_GATHER_S,
    TIMEOUT_S,
    ask_directory,
    directory_call,
    directory_process,
    directory_router,
    eviction_process,
    eviction_status,
    next_admission_filter,
    prefetch_process,
    repair_process,
    segment_process,
    segment_state,
    service_env,
    service_process,
    signed_ref,
)

__all__ = [
    "LIST_PAGES_MAX",
    "SECRET",
    "TEST_GATHER_S",
    "TIMEOUT_S",
    "ask_directory",
    "directory_call",
    "directory_process",
    "directory_router",
    "eviction_process",
    "eviction_status",
    "next_admission_filter",
    "prefetch_process",
    "repair_process",
    "segment_process",
    "segment_state",
    "service_env",
    "service_process",
    "signed_ref",
]
