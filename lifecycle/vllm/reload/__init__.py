"""How a draft is reloaded inside vLLM: the lifecycle classes and their load paths, the epoch boundary, vLLM's
layerwise-reload hooks, shards, partial payloads, and payload planning."""
