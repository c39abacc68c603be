import flows  # noqa: F401  (first: Prefect's environment, its start-up deadline among it, before anything imports Prefect)

# isort: split
import os
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
# The longest files, longest first. `make test` hands each of its two workers a file at a time in this order, so the
# files that take most of a worker's time start first and the short ones fill in beside them: the run ends with both
# workers busy, not on one worker alone with an end-to-end file. Files not named keep their order, after these.
# Seconds per file in one `make test` under `.ci/run` (its 2 cores shared with another test suite for much of it,
# so slower than on a quiet machine): 982, 710, 465, 452, 409, 385, 376, 351, 329, 290; every other file under 200.
LONGEST_FIRST = ("test_release.py", "test_faults.py", "test_own_model.py", "runtime/test_paged_kv.py",
                 "tasks/test_real_model.py", "tasks/test_paged_engines.py", "runtime/test_stacked_adapters.py",
                 "tasks/test_compile.py", "runtime/test_quantized_pages.py", "test_production.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.relative_to(TESTS).as_posix(), len(rank)))


@pytest.fixture(scope="session")
def published(tmp_path_factory):
    """The project after `make release` on the embedded default, once for the whole test run
    (``project_testkit.published_project``): CI's own release when .ci/run has just made it from these files,
    else built by the first xdist worker that needs it. Read only; ``copy_published`` gives a test its own."""
    from project_testkit import published_project

    base = tmp_path_factory.getbasetemp()  # under xdist each worker's, in the run's own folder: share that
    return published_project(base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base)


@pytest.fixture
def process_groups():
    """Long-lived processes a test starts, each in its own process group (``service_testkit.start_service``,
    ``flows.local_server.start_server``): every group is stopped when the test ends, passed or failed,
    the last started first (a command before the server it talks to)."""
    from service_testkit import stop_group

    started = []
    yield started
    for process in reversed(started):
        stop_group(process)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A randomly initialised Llama saved by save_pretrained, standing in for a user's own model."""
    import random

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tasks.inspection import rulebook, sample_examples
    from tasks.stages.base_model import train_tokenizer

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


@pytest.fixture(scope="session")
def tiny_llama_bos_dir(tmp_path_factory):
    """A Llama 3-style checkpoint as users have them: a tokenizer whose post-processor adds BOS,
    an untied head, llama3 RoPE scaling (the tiny head dim spans all three frequency bands), and
    two eos ids in generation_config.json (``</s>`` and ``<|eot_id|>``)."""
    import json
    import random

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from tasks.inspection import rulebook, sample_examples

    path = tmp_path_factory.mktemp("llama_bos")
    examples = sample_examples(rulebook("2026-10", 1234, 2), 64, random.Random(0))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|eot_id|>"]
    tok.train_from_iterator(
        [ex.prompt + ex.completion for ex in examples],
        trainer=trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False),
    )
    bos, eos, eot = (tok.token_to_id(t) for t in specials)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", bos)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(path)
    # Written as Llama checkpoints ship them; transformers 5, like the device, follows the post-processor.
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(config | {"add_bos_token": True, "add_eos_token": False}))
    torch.manual_seed(0)
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
            rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
            bos_token_id=bos, eos_token_id=[eos, eot], pad_token_id=eos,
        )
    ).save_pretrained(path)
    GenerationConfig(bos_token_id=bos, eos_token_id=[eos, eot], pad_token_id=eos).save_pretrained(path)
    return path
