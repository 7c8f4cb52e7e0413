"""The segment storage service: holds KV bytes in a shared-memory arena and serves them."""
