"""Quality studies against the float model: KV-cache and weight quantization on the default month and a real
checkpoint, and what a fine-tune costs the base."""
