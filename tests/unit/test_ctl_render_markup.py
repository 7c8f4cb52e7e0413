"""kvctl prints tenant-chosen text (holder ids of leases and pins) as it is: no rich markup is
parsed from it (`[/]` crashed kvctl with a MarkupError, `[red]...` or `[link=...]` restyled or hid
what the operator sees; review, 2026-12-05)."""

from __future__ import annotations

import pytest

from kvfabric.ctl.render import print_leases
from kvfabric.proto import directory as m


@pytest.mark.parametrize("holder", ["alice/[/]", "alice/[red]x[/red]", "alice/[link=http://e.x]y[/link]"])
def test_a_holder_id_with_markup_is_printed_as_it_is(holder: str, capsys: pytest.CaptureFixture[str]) -> None:
    print_leases([m.LeaseInfo(lease_id=7, holder_id=holder, is_pin=True, groups=1, expires_ms=0)])
    assert holder in capsys.readouterr().out


@pytest.mark.parametrize(
    "holder",
    ["alice/\x1b]0;PWNED\x07", "alice/\x1b[2K\x1b[1Ahidden", "alice/\x9b31mred", "alice/a\rb", "alice/a\nb"],
)
def test_a_holder_id_with_control_characters_reaches_the_terminal_escaped(
    holder: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Escape sequences in a tenant's holder id went to the operator's terminal as they were:
    rows erased or rewritten, the window title set (review, stop 68). Now shown escaped."""
    print_leases([m.LeaseInfo(lease_id=7, holder_id=holder, is_pin=True, groups=1, expires_ms=0)])
    out = capsys.readouterr().out
    assert not any((ord(c) < 0x20 and c != "\n") or 0x7F <= ord(c) <= 0x9F for c in out)
    assert holder.encode("unicode_escape").decode("ascii") in out  # what it is, escaped
