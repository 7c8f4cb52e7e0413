"""kvfabric router service: cache-aware routing over vLLM OpenAI servers."""
