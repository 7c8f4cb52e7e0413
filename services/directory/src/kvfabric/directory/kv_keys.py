"""A JetStream KV bucket's keys, read from its stream's per-subject state (`bucket_keys`).

nats-py's `KeyValue.keys()` lists through an ordered-consumer watcher, and ends the listing at
the watcher's first "nothing pending" marker. That marker can come too early (nats.py issue
#842, pull request #995, still open): when the consumer's info shows nothing pending while its
deliveries are still in flight to the client (the listing ends before its first key, and
`NoKeysError` reads as "no keys"), or when one message's pending count reaches 0 and rises again
under concurrent writes on a NATS cluster (a partial listing). A directory shard started by a
handover on a CI run asked no segment for its report, twice in a row, while both were
registered (docs/directory-ha.md).

`STREAM.INFO` with a subjects filter is one request, answered by the stream's leader from the
stream's own state: every subject that holds a message. In the buckets listed here that is every
key with a value: none of them deletes a key (a deleted key's tombstone is a message, and would
be listed), and a key past the bucket's max age is gone from the stream.

Bound: the server sends at most `SUBJECT_DETAILS_MAX` subjects in one answer; a listing of that
many is refused (`KeyListingTruncated`), never read in part (the buckets here hold a few keys
per segment, member or repair).
"""

from __future__ import annotations

from typing import Final

from nats.js import JetStreamContext

__all__ = ["SUBJECT_DETAILS_MAX", "KeyListingTruncated", "bucket_keys"]

SUBJECT_DETAILS_MAX: Final = 100_000  # nats-server's JSMaxSubjectDetails: one STREAM.INFO's subjects


class KeyListingTruncated(RuntimeError):
    """A bucket with more keys than one stream info answer carries."""


async def bucket_keys(js: JetStreamContext, bucket: str) -> list[str]:
    """Every key of `bucket` that holds a message, sorted (see the module docstring). Raises
    nats-py's errors when the stream does not answer (`NotFoundError` when there is none)."""
    prefix = f"$KV.{bucket}."
    info = await js.stream_info(f"KV_{bucket}", subjects_filter=f"{prefix}>")
    subjects = info.state.subjects or {}
    if len(subjects) >= SUBJECT_DETAILS_MAX:
        raise KeyListingTruncated(f"bucket {bucket} has {SUBJECT_DETAILS_MAX} keys or more")
    return sorted(subject.removeprefix(prefix) for subject in subjects)
