"""kvfabric prefetch service."""
