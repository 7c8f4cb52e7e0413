"""kvfabric protocol cores: synchronous, I/O-free state machines, `step(event, now_ms) -> effects`."""
