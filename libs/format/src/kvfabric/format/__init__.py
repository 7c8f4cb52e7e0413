"""kvfabric formats: KV keys, manifests, generations, errors. Pure code, no I/O."""
