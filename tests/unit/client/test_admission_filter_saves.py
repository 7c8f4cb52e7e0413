"""A save's `not_admitted` answers (issue 25 item 4): the refused chunk and every later chunk of
the save are not written, counted under cause `not_admitted`, and reported as not stored."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvfabric.client.saves import SaveTally
from kvfabric.format.ids import ObjectKey
from kvfabric.proto import directory as m
from tests.unit.client.test_saves import plan, ticket


def begin(keys: list[ObjectKey], statuses: list[str]) -> list[m.BeginResult]:
    return [
        m.BeginResult(key=k, status=s, tickets=[ticket(k, "a")] if s == "placed" else [])  # type: ignore[arg-type]
        for k, s in zip(keys, statuses, strict=True)
    ]


def test_chunks_from_the_first_not_admitted_one_are_not_written_and_counted() -> None:
    keys, p = plan(5)
    tally = SaveTally(p)
    placed = tally.begun(begin(keys, ["placed", "exists", "not_admitted", "placed", "placed"]))
    to_write, unwritten = tally.unreachable(placed)
    assert [r.key for r in to_write] == [keys[0]]
    assert unwritten == keys[3:]
    ok, bad = tally.wrote(to_write, ["ok"])
    assert ok == [keys[0]] and bad == []
    tally.commits([m.CommitResult(key=keys[0], status="published")])
    result = tally.result()
    assert (result.chunks_saved, result.chunks_existing, result.chunks_failed) == (1, 1, 3)
    assert result.causes == {"not_admitted": 3}
    assert result.bytes_written == len(p.data[keys[0]])


def test_without_refusals_everything_placed_is_written() -> None:
    keys, p = plan(3)
    tally = SaveTally(p)
    placed = tally.begun(begin(keys, ["placed"] * 3))
    assert tally.unreachable(placed) == (placed, [])


@given(st.lists(st.sampled_from(("placed", "exists", "not_admitted", "no_capacity")), min_size=1, max_size=8))
def test_nothing_at_or_after_a_refused_chunk_is_written(statuses: list[str]) -> None:
    keys, p = plan(len(statuses))
    tally = SaveTally(p)
    placed = tally.begun(begin(keys, statuses))
    to_write, unwritten = tally.unreachable(placed)
    first = statuses.index("not_admitted") if "not_admitted" in statuses else len(statuses)
    assert {r.key for r in to_write} == {
        k for k, s in zip(keys, statuses, strict=True) if s == "placed"
    } - set(keys[first:])
    assert set(unwritten) == {k for k, s in zip(keys[first:], statuses[first:], strict=True) if s == "placed"}
    tally.wrote(to_write, ["ok"] * len(to_write))
    tally.commits(m.CommitResult(key=r.key, status="published") for r in to_write)
    result = tally.result()
    assert result.chunks_saved + result.chunks_existing + result.chunks_failed == len(statuses)
    assert result.chunks_saved <= first
    refused_or_dropped = statuses[first:].count("not_admitted") + len(unwritten)
    assert result.causes.get("not_admitted", 0) == refused_or_dropped
