"""kvfabric data plane: payload bytes between clients and segments, never over NATS.

- `frames`: the binary framing every transport shares (pure).
- `backend`: what a segment offers its transports (`SegmentBackend` protocol).
- `tcp`: threaded TCP server and a blocking client (recv_into the slot, sendmsg from it).
- `shm`: the zero-copy-map local path for a client on the segment's host.
- `ucx`: the same protocol over UCX (ucxx), optional.
"""
