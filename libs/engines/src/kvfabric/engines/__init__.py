"""kvfabric engine integrations.

- `hf`: save and load a transformers causal LM's prefix KV (`HfKvAdapter`); the light path.
- `vllm_connector`: `KvfabricConnector`, a vLLM v1 `KVConnectorBase_V1` loaded by
  `kv_connector_module_path="kvfabric.engines.vllm_connector"`.
- `identity`: model fingerprints (weights digests) shared by both.

Neither module is imported here: each pulls in its engine (torch, transformers, vllm).
"""
