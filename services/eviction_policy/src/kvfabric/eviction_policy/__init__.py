"""kvfabric eviction-policy service."""
