"""TLS for the TCP data plane (by config; off by default).

A segment with a certificate serves only `tls://` (and no UCX, which would bypass it); readers
and copying segments verify it against a CA bundle. `kvctl auth init --tls` writes a private CA
and a certificate for loopback that both NATS and the segments can use (docs/security.md).
Zero-copy is lost under TLS (bytes are encrypted from and decrypted into the same buffers, but
`sendmsg` scatter-gather is not available): measured in docs/security.md.
"""

from __future__ import annotations

import ssl

__all__ = ["client_context", "server_context"]


def server_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_file, key_file)
    return context


def client_context(ca_file: str) -> ssl.SSLContext:
    """Verifies the segment's certificate (and its host name) against `ca_file`."""
    return ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
