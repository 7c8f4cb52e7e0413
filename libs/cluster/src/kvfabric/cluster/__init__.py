"""Caller-side cluster library (issue 26): code that the client and the services acting as callers
share, so that services never import `kvfabric.client` (an import contract in `make lint`).

- `kvfabric.cluster.replicas`: `copy_replica`, one more replica of a published object, copied
  segment to segment (repair, prefetch).
- `kvfabric.cluster.lookups`: `lookup_prefix`, one prefix's lookup over the directory's shards
  (one request per leading instance), merged by one rule, the unneeded leases given back
  (client, prefetch).

The request/reply helper, the shard router and NATS auth still live in `kvfabric.runtime`
(`client`, `directory_router`, `natsauth`); issue 26 moves them here.
"""
