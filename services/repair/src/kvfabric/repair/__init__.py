"""kvfabric repair service."""
