"""Caller-side cluster library (issue 26): code that the client, kvctl and the services acting as
callers share, so that services never import `kvfabric.client` and the client never imports the
service runtime `kvfabric.runtime` (import contracts in `make lint`).

- `kvfabric.cluster.requests`: `request`, one typed call (`Indeterminate` on timeout,
  `Unavailable` on no responders); `error_from_response`, the `KvfError` a reply carries.
- `kvfabric.cluster.directory_router`: `DirectoryRouter`, the cached shard map and directory
  calls routed by shard (fenced by epoch, refreshed on `wrong_shard`).
- `kvfabric.cluster.natsauth`: `NatsAuth`, `nats_auth_from_env`: how a process authenticates to
  NATS (services, kvctl and the client read the same variables).
- `kvfabric.cluster.replicas`: `copy_replica`, one more replica of a published object, copied
  segment to segment (repair, prefetch).
- `kvfabric.cluster.lookups`: `lookup_prefix`, one prefix's lookup over the directory's shards
  (one request per leading instance), merged by one rule, the unneeded leases given back
  (client, prefetch).
"""
