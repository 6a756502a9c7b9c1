"""The policy network: its configuration and presets, the Qwen2 modules, parameter sharding
and Hugging Face conversion."""
