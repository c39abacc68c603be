import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A randomly initialised Llama saved by save_pretrained, standing in for a user's own model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tasks.base_model import train_tokenizer
    from tasks.data import rulebook, sample_examples
    import random

    path = tmp_path_factory.mktemp("llama")
    examples = sample_examples(rulebook("2026-10", 1234, 2), 64, random.Random(0))
    tokenizer = train_tokenizer([ex.prompt + ex.completion for ex in examples], 300, path)
    torch.manual_seed(0)
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        )
    ).save_pretrained(path)
    return path
