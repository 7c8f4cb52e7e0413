from __future__ import annotations

import pytest

from kvfabric.proto.subjects import Service, endpoint_subject, event_subject, events_wildcard, service_group


def test_subjects_are_versioned_and_built_from_tokens() -> None:
    assert endpoint_subject(Service.DIRECTORY, "lookup") == "kvf.v1.directory.lookup"
    assert service_group(Service.SEGMENT) == "kvf.v1.segment"
    assert event_subject(Service.DIRECTORY, "published") == "kvf.v1.events.directory.published"
    assert events_wildcard() == "kvf.v1.events.*.>"
    assert events_wildcard(Service.SEGMENT) == "kvf.v1.events.segment.>"
    assert endpoint_subject(Service.ECHO, "say", version=2) == "kvf.v2.echo.say"


@pytest.mark.parametrize("verb", ["", "Lookup", "a.b", "a b", "*", ">", "x" * 64])
def test_bad_verb_is_rejected(verb: str) -> None:
    with pytest.raises(ValueError, match="invalid subject verb"):
        endpoint_subject(Service.DIRECTORY, verb)
