"""`kvctl`: the operator CLI of kvfabric.

- `cli`: the typer commands (`status`, `key decode`, `objects ls`, `manifest show`, `leases ls`,
  `pins add/rm`, `segment drain`, `events tail`); each runs its async query with `asyncio.run`.
- `queries`: the NATS side: connect, typed directory/segment calls, `$SRV.PING` gather, events.
- `render`: rich tables for people, plain JSON (`--json`, bytes as hex) for scripts.

Read commands use only the directory's read-only query verbs: they never grant a lease.
"""
