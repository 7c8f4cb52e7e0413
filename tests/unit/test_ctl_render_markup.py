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
