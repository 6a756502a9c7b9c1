"""The policy network: its configuration and presets, the Qwen2 modules, the KV cache,
token log-probs and entropy, parameter sharding and Hugging Face conversion."""
