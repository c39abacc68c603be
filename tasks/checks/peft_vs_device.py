"""Does the device answer what PEFT answers? A published release checked the way its user would.

The reference is the user's own stack only: transformers loads the base model, ``PeftModel.from_pretrained``
loads the release directory (a PEFT adapter), transformers' own tokenizer encodes the prompt (its
``apply_chat_template`` for chat rows) and ``generate`` decodes greedily to the base's eos. The device is
the release served by the runtime, asked through the openai SDK: ``/v1/completions`` for every row
(for a chat row, its last user message as the prompt) and ``/v1/chat/completions`` for chat rows.
The prompts are the month's test rows. Every pair of answers is printed; any difference, or a device
serving another release than the one PEFT loaded, exits 1.

A device serving quantized pages (``engine.kv_cache: quantized_pages``) reads sealed pages at 4 bits where PEFT reads
a float cache, so an answer may differ because of the cache alone. Its answers are then also compared with its own
PyTorch module reading the same pages (the release merged into the base, ``tasks.checks.page_quality``): that pair must
agree on every row (a difference is a defect of the device); a PEFT difference the module shares is the cache's cost,
counted and printed, and exits 1 only beyond ``--max-cache-differences``.

    python -m tasks.checks.peft_vs_device --params examples/smollm2.yaml            # serves the release in this process
    python -m tasks.checks.peft_vs_device --params examples/smollm2.yaml --url http://127.0.0.1:8080/v1
                                   # asks a running `python -m runtime serve` with that release instead
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from runtime.engine.tokenizer import ChatPrompt
from runtime.release.contract import MANIFEST
from tasks.config import ReleaseConfig, load_config
from tasks.layout import RELEASE_DIR
from tasks.records import read_jsonl

Prompt = str | list[dict]  # a completion prompt, or a chat's messages


@dataclass(frozen=True)
class Answer:
    row: int  # 1-based line of test.jsonl
    endpoint: str  # "completions" | "chat"
    prompt: Prompt
    peft: str
    device: str
    module: str | None = None  # the device's PyTorch module through the same quantized pages (None: a float cache)

    @property
    def equal(self) -> bool:
        return self.peft == self.device

    @property
    def module_equal(self) -> bool:
        return self.module is None or self.module == self.device


def asked_prompts(test_jsonl: Path, limit: int | None = None) -> list[tuple[int, str, Prompt]]:
    """(row, endpoint, prompt) for each test row: a chat row is asked both ways, a raw row as a completion."""
    out: list[tuple[int, str, Prompt]] = []
    for line, ex in enumerate(read_jsonl(test_jsonl)[:limit], start=1):
        if isinstance(ex.prompt, ChatPrompt):
            messages = [dict(m) for m in ex.prompt.messages]
            out += [(line, "chat", messages), (line, "completions", messages[-1]["content"])]
        else:
            out.append((line, "completions", ex.prompt))
    return out


def peft_greedy(base_dir: Path, release_dir: Path, prompts: list[Prompt], max_new_tokens: int) -> list[str]:
    """Greedy answers of the release loaded by PEFT on the base, through transformers alone."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                                      release_dir).eval()
    eos = GenerationConfig.from_pretrained(base_dir).eos_token_id  # one id, or a list (Llama 3 ends on any of three)
    pad = tokenizer.pad_token_id
    if pad is None:  # generate pads finished rows with one id: the (first) eos, as it warns it would
        pad = eos if isinstance(eos, int) else eos[0]
    answers = []
    with torch.no_grad():
        for prompt in prompts:
            ids = (tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else
                   tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_dict=True)["input_ids"])
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                                 pad_token_id=pad)
            answers.append(tokenizer.decode(out[0, len(ids):], skip_special_tokens=True))
    return answers


def device_greedy(url: str, prompts: list[Prompt], max_tokens: int) -> tuple[str, list[str]]:
    """(the served model's id, its answers at temperature 0) through the openai SDK at ``url`` (``.../v1``)."""
    import openai

    client = openai.OpenAI(base_url=url, api_key="unused-by-the-device", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    answers = []
    for prompt in prompts:
        if isinstance(prompt, str):
            answers.append(client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                     temperature=0).choices[0].text)
        else:
            answers.append(client.chat.completions.create(model=model, messages=prompt, max_tokens=max_tokens,
                                                          temperature=0).choices[0].message.content)
    return model, answers


@contextlib.contextmanager
def serving(engine_dir: Path, tokenizer_dir: Path, release_dir: Path, trusted_key: Path, backend: str = "onnxruntime",
            threads: int = 2):
    """The release on the device's app (what ``python -m runtime serve`` runs) under uvicorn in this
    process; yields its ``.../v1`` URL."""
    from runtime.engine.engine import open_engine
    from runtime.engine.tokenizer import DeviceTokenizer
    from runtime.release.verify import load_trusted_keys
    from runtime.serve.http_app import ServeSettings
    from runtime.serve.http_server import BackgroundServer
    from runtime.serve.server import AdapterServer

    app = AdapterServer(open_engine(engine_dir, backend, threads=threads), DeviceTokenizer(tokenizer_dir),
                        load_trusted_keys([trusted_key]))
    with BackgroundServer(app, ServeSettings()) as background:
        app.load(release_dir)
        yield f"{background.url}/v1"


def pages_greedy(base_dir: Path, release_dir: Path, engine_dir: Path, prompts: list[Prompt],
                 max_new_tokens: int) -> list[str]:
    """Greedy answers of the release merged into the base, in PyTorch, reading the engine's quantized pages as the
    device does (``tasks.checks.page_quality.greedy_through_pages``), prompts encoded as the device encodes them."""
    from kernels.kv_spec import PageQuantSpec
    from runtime.engine.interface import read_interface
    from tasks.checks.page_quality import greedy_through_pages
    from tasks.models import load_release_backbone, load_tokenizer

    iface = read_interface(engine_dir)
    backbone, _, _ = load_release_backbone(base_dir, release_dir, engine_dir)
    asked = [p if isinstance(p, str) else ChatPrompt(tuple(p)) for p in prompts]
    return greedy_through_pages(backbone, load_tokenizer(base_dir), asked, PageQuantSpec.from_dict(iface.kv_pages),
                                iface.kv_block_size, max_new_tokens)


def compare(base_dir: Path, release_dir: Path, url: str, test_jsonl: Path, max_new_tokens: int,
            limit: int | None = None, engine_dir: Path | None = None) -> tuple[str, list[Answer]]:
    """(the served model's id, one ``Answer`` per test prompt and endpoint); with ``engine_dir`` of a quantized-pages
    engine, each with the module's answer through the same pages."""
    from runtime.engine.interface import read_interface

    asked = asked_prompts(test_jsonl, limit)
    prompts = [p for _, _, p in asked]
    model, device = device_greedy(url, prompts, max_new_tokens)
    peft = peft_greedy(base_dir, release_dir, prompts, max_new_tokens)
    module = [None] * len(prompts)
    if engine_dir is not None and read_interface(engine_dir).kv_pages:
        module = pages_greedy(base_dir, release_dir, engine_dir, prompts, max_new_tokens)
    return model, [Answer(row, endpoint, prompt, p, d, m)
                   for (row, endpoint, prompt), p, d, m in zip(asked, peft, device, module)]


def release_id(release_dir: Path) -> str:
    return json.loads((release_dir / MANIFEST).read_text())["release_id"]


def render(model: str, release: str, answers: list[Answer]) -> str:
    def shown(prompt: Prompt) -> str:
        text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
        return text if len(text) <= 48 else text[:45] + "..."

    pages = any(a.module is not None for a in answers)
    lines = [f"PEFT loaded release {release}; the device serves {model}"
             + ("" if model == release else " (ANOTHER RELEASE)"),
             "| row | endpoint | prompt | PEFT | device | equal |" + (" module through the pages | equal |" if pages else ""),
             "|---|---|---|---|---|---|" + ("---|---|" if pages else "")]
    lines += [f"| {a.row} | {a.endpoint} | {shown(a.prompt)} | {a.peft!r} | {a.device!r} | {'yes' if a.equal else 'NO'} |"
              + (f" {a.module!r} | {'yes' if a.module_equal else 'NO'} |" if pages else "") for a in answers]
    for endpoint in sorted({a.endpoint for a in answers}):
        mine = [a for a in answers if a.endpoint == endpoint]
        lines.append(f"{endpoint}: {sum(a.equal for a in mine)} of {len(mine)} answers equal to PEFT's"
                     + (f", {sum(a.module_equal for a in mine)} of {len(mine)} to the module's through the same pages"
                        if pages else ""))
    return "\n".join(lines)


def verdict(model: str, release: str, answers: list[Answer], max_cache_differences: int) -> bool:
    """Whether the device passes: the release PEFT loaded, every answer its module's through the same cache, and
    at most ``max_cache_differences`` answers other than PEFT's (each then the quantized pages', as the module shows)."""
    return (model == release and all(a.module_equal for a in answers)
            and sum(not a.equal for a in answers) <= max_cache_differences)


def release_paths(cfg: ReleaseConfig) -> dict:
    """Where the profile's published release, its device engine, tokenizer, key and test rows lie."""
    from runtime.release.signing import public_key_path

    layout = cfg.layout
    return {"base_dir": Path(cfg.base_model.path), "release_dir": layout.package_dir / RELEASE_DIR,
            "engine_dir": layout.serving_engine_dir, "trusted_key": public_key_path(cfg.publish.signing_key),
            "test_jsonl": layout.data_dir / "test.jsonl"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Compare a release's greedy answers through PEFT on the base with "
                                                 "the device's, through the openai SDK, on the month's test rows")
    parser.add_argument("--params", type=Path, default=Path("params.yaml"), help="the profile the release was made with")
    parser.add_argument("--url", help="a running device's .../v1 URL serving that release "
                                      "(default: serve it in this process on the profile's serving engine)")
    parser.add_argument("--rows", type=int, default=None, help="the first N test rows (default: all)")
    parser.add_argument("--max-cache-differences", type=int, default=0,
                        help="answers a quantized-pages device may give otherwise than PEFT's float cache, each the "
                             "same as its module's through the same pages (default 0)")
    args = parser.parse_args(argv)
    cfg = load_config(args.params)
    paths = release_paths(cfg)
    for name in ("release_dir", "engine_dir", "test_jsonl"):
        if not paths[name].exists():
            print(f"error: {paths[name]} not found: publish a release with this profile first", file=sys.stderr)
            return 2
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(serving(paths["engine_dir"], paths["base_dir"], paths["release_dir"],
                                                      paths["trusted_key"], cfg.engine.backend, cfg.engine.threads))
        model, answers = compare(paths["base_dir"], paths["release_dir"], url, paths["test_jsonl"],
                                 cfg.eval.max_new_tokens, args.rows, paths["engine_dir"])
    release = release_id(paths["release_dir"])
    print(render(model, release, answers))
    return 0 if verdict(model, release, answers, args.max_cache_differences) else 1


if __name__ == "__main__":
    sys.exit(main())
