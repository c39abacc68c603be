"""The fine-tune stage: a LoRA adapter for this month's rules, trained with PEFT.

Only the LoRA matrices are saved, in PEFT's own format (``adapter_config.json`` +
``adapter_model.safetensors``) so ``PeftModel.from_pretrained`` loads them unchanged; a
``provenance.json`` beside them binds the adapter to the exact backbone and settings, and says
where it was trained (device, precision, processes: ``tasks/device.py``). With ``train.processes``
> 1 the entry point launches itself on that many ranks with ``accelerate launch``; rank 0 writes.
With ``train.rehearsal_share`` a share of each batch is general text (``data.rehearsal_text``), refused if it
holds any of the held-out text the forgetting gate scores.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

from runtime.engine.adapter_config import PROVENANCE
from tasks.artifacts import atomic_output_dir, write_json
from tasks.cli import stage_main
from tasks.config import ConfigError, LoraSection, ReleaseConfig, StageError, TrainConfig
from tasks.device import choose_placement, is_launched_rank, launch_command, rank_accelerator
from tasks.layout import ADAPTER_DIR
from tasks.models import load_base_model
from tasks.records import (
    REHEARSAL_TEXT,
    DataError,
    heldout_corpus,
    heldout_overlaps,
    is_chat,
    read_jsonl,
    read_numbered_text,
)


def library_versions() -> dict[str, str]:
    import accelerate
    import peft
    import torch
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "accelerate": accelerate.__version__,
    }


def _prompt_loss_weight(examples: list, configured: float) -> float:
    """The configured weight of prompt tokens; 0 for chat rows, whose loss covers only the assistant's
    turns (as TRL's assistant-only loss), said when that overrides a configured weight."""
    if configured and is_chat(examples[0]):
        print(f"train.prompt_loss_weight {configured} not applied: the rows are chats, the loss covers only "
              "assistant turns", file=sys.stderr)
        return 0.0
    return configured


def rehearsal_texts(data_dir: Path) -> list[str]:
    """The documents of the month's rehearsal text (the data stage's copy of ``data.rehearsal_text``); refused, naming
    the line and the text, if any held-out text (``heldout_corpus``: what the forgetting gate scores) lies inside one:
    training on it would hide the very forgetting the gate measures."""
    path = Path(data_dir) / REHEARSAL_TEXT
    if not path.exists():
        raise DataError(f"{path}: not found: train.rehearsal_share needs data.rehearsal_text, which the data stage "
                        "copies here; set it and run the data stage")
    numbered = read_numbered_text(path)
    heldout_path, heldout = heldout_corpus(data_dir)
    overlaps = heldout_overlaps([text for _, text in numbered], heldout)
    if overlaps:
        found = "; ".join(f"line {numbered[i][0]} holds {text[:60]!r}..." for i, text in overlaps[:3])
        raise DataError(f"{path} (data.rehearsal_text): {len(overlaps)} held-out text(s) of {heldout_path} inside "
                        f"rehearsal documents: {found}; remove those documents: the forgetting gate scores the base "
                        "on that text")
    return [text for _, text in numbered]


def finetune(
    base_dir: Path,
    data_dir: Path,
    out_dir: Path,
    lora: LoraSection,
    train: TrainConfig,
    params_hash: str,
    engine_dir: Path | None = None,
) -> Path:
    """Train a LoRA adapter on ``data_dir/train.jsonl``; write it, its loss curve and provenance.

    ``out_dir`` receives ``adapter/``, ``loss.csv``, ``val_loss.csv``, ``loss.png`` and ``train_metrics.json``;
    it is replaced as a whole only when training finished with a finite loss. It trains on the device
    ``train.device`` picks; inside an ``accelerate launch`` every rank trains and only the main one writes. With a compiled
    ``engine_dir`` the adapter is bound to that engine's interface too; an engine compiled for
    another backbone is refused before training.
    """
    import torch
    from peft import LoraConfig, get_peft_model

    from runtime.engine.hashing import backbone_hash
    from runtime.engine.interface import INTERFACE_FILE, read_interface
    from tasks.training import TrainSettings, train_completions, write_loss_curve

    base_hash = backbone_hash(base_dir)
    interface_hash = None
    if engine_dir is not None and (Path(engine_dir) / INTERFACE_FILE).exists():
        iface = read_interface(engine_dir)
        if iface.backbone_hash != base_hash:
            raise ConfigError(
                f"{engine_dir}: engine was compiled for another backbone; run `python -m tasks.stages.compile` first"
            )
        interface_hash = iface.lora_contract_hash
    torch.set_num_threads(train.threads)
    placement = choose_placement(train.device)
    accelerator = rank_accelerator(placement) if is_launched_rank() else None
    processes = accelerator.num_processes if accelerator is not None else 1
    main_process = accelerator is None or accelerator.is_main_process
    if main_process:
        print(f"fine-tune: {placement.describe()}, {processes} process(es)", file=sys.stderr)
    examples = read_jsonl(Path(data_dir) / "train.jsonl")
    rehearsal = rehearsal_texts(data_dir) if train.rehearsal_rows else []
    if rehearsal and main_process:
        print(f"fine-tune: rehearsal, {train.rehearsal_rows} of {train.batch_size} rows per batch from "
              f"{len(rehearsal)} documents of {Path(data_dir) / REHEARSAL_TEXT}", file=sys.stderr)
    model, tokenizer = load_base_model(base_dir)
    missing = [m for m in lora.target_modules if not any(n.endswith(m) for n, _ in model.named_modules())]
    if missing:
        raise ConfigError(f"lora.target_modules: {missing} not found in the base model at {base_dir}")
    torch.manual_seed(train.seed)
    peft_model = get_peft_model(
        model,
        LoraConfig(
            r=lora.r,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=list(lora.target_modules),
            task_type="CAUSAL_LM",
        ),
    )
    settings = TrainSettings(
        steps=train.steps,
        batch_size=train.batch_size,
        lr=train.lr,
        weight_decay=train.weight_decay,
        warmup_steps=train.warmup_steps,
        max_seq_len=train.max_seq_len,
        seed=train.seed,
        prompt_loss_weight=_prompt_loss_weight(examples, train.prompt_loss_weight),
        rehearsal_rows=train.rehearsal_rows,
    )
    history = train_completions(peft_model, tokenizer, examples, settings, desc="fine-tune LoRA",
                                val_examples=read_jsonl(Path(data_dir) / "val.jsonl"), eval_every=train.eval_every,
                                placement=placement, accelerator=accelerator, rehearsal_texts=rehearsal)
    if accelerator is not None:
        accelerator.wait_for_everyone()
        accelerator.end_training()  # leaves the process group; the ranks agree on every step, so all are done
    if not main_process:
        return Path(out_dir) / ADAPTER_DIR

    with atomic_output_dir(Path(out_dir)) as tmp:
        adapter_dir = tmp / ADAPTER_DIR
        peft_model.save_pretrained(adapter_dir)
        provenance = {
            "base_model_hash": base_hash,
            "base_model_path": str(base_dir),
            "params_hash": params_hash,
            "train_examples": len(examples),
            "libraries": library_versions(),
            "device": placement.device,
            "precision": placement.precision,
            "processes": processes,
        }
        if interface_hash is not None:
            provenance["engine_interface_hash"] = interface_hash
        write_json(adapter_dir / PROVENANCE, provenance)
        # Bytes on disk, whole folders: what a device downloads versus what it already has.
        adapter_bytes = sum(f.stat().st_size for f in adapter_dir.iterdir())
        base_bytes = sum(f.stat().st_size for f in Path(base_dir).glob("*.safetensors"))
        write_loss_curve(history, tmp, "LoRA fine-tuning")
        write_json(
            tmp / "train_metrics.json",
            {
                "final_loss": history.train[-1],
                "final_val_loss": history.val[-1][1] if history.val else None,
                "steps": len(history.train),
                "trainable_parameters": sum(p.numel() for p in peft_model.parameters() if p.requires_grad),
                "adapter_bytes": adapter_bytes,
                "base_model_bytes": base_bytes,
                "adapter_fraction_of_base": adapter_bytes / base_bytes,
                "device": placement.device,
                "precision": placement.precision,
                "processes": processes,
                **({"rehearsal_rows_per_batch": train.rehearsal_rows, "rehearsal_documents": len(rehearsal)}
                   if rehearsal else {}),
            },
        )
    return Path(out_dir) / ADAPTER_DIR


def run_stage(cfg: ReleaseConfig) -> Path:
    return finetune(
        base_dir=Path(cfg.base_model.path),
        data_dir=cfg.layout.data_dir,
        out_dir=cfg.layout.finetune_dir,
        lora=cfg.lora,
        train=cfg.train,
        params_hash=cfg.params_hash(),
        engine_dir=cfg.layout.engine_dir,
    )


def launch_or_run(cfg: ReleaseConfig, argv: list[str]) -> str:
    """Run the stage here, or, with ``train.processes`` > 1 outside a launched rank, start the ranks
    (``accelerate launch`` of this same command) and wait for them."""
    if cfg.train.processes == 1 or is_launched_rank():
        adapter = run_stage(cfg)
        rank = os.environ.get("RANK", "0")  # set in every rank by torch.distributed.run
        return f"adapter written to {adapter}" if rank == "0" else f"rank {rank} trained; rank 0 writes the adapter"
    done = subprocess.run(launch_command("tasks.stages.finetune", argv, cfg.train.processes))
    if done.returncode:
        raise StageError(f"fine-tune on {cfg.train.processes} processes failed (accelerate launch exit "
                         f"{done.returncode}); the ranks' errors are above")
    return f"adapter written to {cfg.layout.adapter_dir} by {cfg.train.processes} processes"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    return stage_main("Fine-tune this month's LoRA adapter.", lambda cfg: launch_or_run(cfg, args), argv)


if __name__ == "__main__":
    sys.exit(main())
