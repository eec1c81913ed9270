"""The composition root of the vLLM layer: activation, the patch registry, the capability check, the Ray nodes
check."""
