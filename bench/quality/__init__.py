"""Quality studies: KV-cache and weight quantization schemes against the float model, on stdlib text, the default
month and a real checkpoint."""
