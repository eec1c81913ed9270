"""vLLM as the plugin finds it: its sources, read without importing vLLM, its version, and the mechanics of
changing it (the patch records and the one function that applies them)."""
