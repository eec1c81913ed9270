"""What a vLLM draft is to the lifecycle: the family declarations, the modules a draft owns, its frozen
structure, where its fused K/V rows live, quantized drafts, and the per-draft runtime state."""
