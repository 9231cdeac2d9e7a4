"""model=hf's export (src/export.py): a finished run's model as a Hugging Face directory that transformers (or peft)
loads with from_pretrained. The transformers model is written by its own save_pretrained (config.json,
model.safetensors, generation_config.json where the model generates), with the run's tokenizer (model.tokenizer, the
data's) where it has one. A LoRA run: the adapter merged into the base weights (merge=true: a plain model), or the
adapter alone (merge=false: peft's adapter_config.json and adapter_model.safetensors, on the base the run started
from, model.pretrained). The model is the run's as trained, in fp32: its logits are the run's.
"""

import contextlib
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from trainkit.data import tokenizer as hf_tokenizer
from trainkit.errors import ConfigError
from trainkit.models.hf import KINDS, core, file_name, local_dir


def check_export(run_cfg: DictConfig, merge: bool) -> None:
    """Before the model is built: merge=false asks for an adapter alone, on a base one can load by name."""
    if merge:
        return
    if not run_cfg.model.get("adapter"):
        raise ConfigError(
            "merge=false writes a LoRA adapter alone, and this run has none (model.adapter is null): its export is "
            "the whole model (merge=true)"
        )
    if run_cfg.model.get("pretrained") is None:
        raise ConfigError(
            "merge=false: an adapter's base is the run's model.pretrained, and this run has none (a fresh model from "
            "model.config): export the adapter merged (merge=true)"
        )


def export(model: Any, run_cfg: DictConfig, directory: Path, merge: bool, out: str) -> str:
    """Write `model` (an HFModel with the run's weights) into `directory` (the engine renames it to `out`); returns
    what was written and how it loads, for the engine's one line."""
    node = run_cfg.model
    pretrained = node.get("pretrained")
    auto = KINDS.get(str(node.kind), str(node.kind))  # AutoModelForCausalLM, ... or the class itself
    with quiet():
        if node.get("adapter") and not merge:
            _same_base(model, str(pretrained))
            net = model.net
            net.peft_config["default"].base_model_name_or_path = str(pretrained)  # as given, not the cache's path
            # save_embedding_layers: peft's "auto" asks the Hub whether the vocabulary was resized; trainkit never
            # resizes it (the embedding is the pretrained one's shape), so the base's embedding is the base's.
            net.save_pretrained(str(directory), save_embedding_layers=False)
            what, base = "the LoRA adapter alone", f", for the base model.pretrained={pretrained}"
            args = _base_args(core(net), str(pretrained))
            how = f"PeftModel.from_pretrained({auto}.from_pretrained({str(pretrained)!r}{args}), {out!r})"
        else:
            hf = model.net.merge_and_unload() if node.get("adapter") else core(model.net)
            if getattr(hf.config, "use_cache", None) is False:
                hf.config.use_cache = True  # off for training (model_config); transformers' default for generation
            if pretrained is not None and hf.can_generate():
                _pretrained_generation_config(hf, str(pretrained))
            hf.save_pretrained(str(directory))
            what, base = type(hf).__name__ + (" with its LoRA adapter merged" if node.get("adapter") else ""), ""
            how = f"{auto}.from_pretrained({out!r})"
        tokenizer = node.get("tokenizer")
        if tokenizer is not None:
            hf_tokenizer.load(str(tokenizer), key="model.tokenizer").save_pretrained(str(directory))
    files = ", ".join(sorted(p.name for p in directory.iterdir()))
    said = f"the tokenizer {tokenizer}" if tokenizer is not None else "no tokenizer (the run's data.tokenizer is unset)"
    return f"{what} ({files}) to {out}{base}; {said}; loads with {how}"


def _same_base(model: Any, pretrained: str) -> None:
    """merge=false: the adapter alone reproduces the run only on the base it trained on. Every base tensor of the
    run's weights (the adapter's own and peft's copies of modules_to_save aside) must be model.pretrained's, bit for
    bit: not so after model.init from another run, or with a new head the files lack (modules_to_save keeps one)."""
    from safetensors import safe_open

    directory = Path(local_dir(pretrained))
    opened = [safe_open(str(f), framework="pt") for f in sorted(directory.glob("*.safetensors"))]
    where = {key: f for f in opened for key in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    prefix = core(model.net).base_model_prefix
    persistent = set(model.state_dict())
    tensors = list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers() if n in persistent]
    for name, value in tensors:  # tied tensors once (named_parameters' default), under their first name
        if "lora_" in name or ".modules_to_save." in name or ".original_module." in name:
            continue
        own = file_name(name)
        key = next((k for k in (own, f"{prefix}.{own}", own.removeprefix(f"{prefix}.")) if k in where), None)
        if key is None:
            raise ConfigError(
                f"merge=false: the run's {own} is not in model.pretrained={pretrained}'s files (a new head?), and "
                "the adapter alone does not hold it: export merged (merge=true), or train with "
                "model.adapter.modules_to_save naming it"
            )
        if not torch.equal(where[key].get_tensor(key).to(value.dtype), value.detach().cpu()):
            raise ConfigError(
                f"merge=false: the run's base weights are not model.pretrained={pretrained}'s ({own} differs: "
                "model.init?), so the adapter alone on it is not the run's model: export merged (merge=true)"
            )


def _base_args(hf: Any, pretrained: str) -> str:
    """The from_pretrained keywords that build the run's base from model.pretrained where its config says otherwise:
    a classification head's classes (num_labels), the padding id the run took from its tokenizer (pad_token_id)."""
    from transformers import AutoConfig

    theirs = AutoConfig.from_pretrained(local_dir(pretrained))
    keys = [k for k in ("num_labels", "pad_token_id") if getattr(hf.config, k, None) != getattr(theirs, k, None)]
    return "".join(f", {k}={getattr(hf.config, k)!r}" for k in keys)


def _pretrained_generation_config(hf: Any, pretrained: str) -> None:
    """The pretrained dir's own generation settings (its generation_config.json), which a model built from its
    config alone (models/hf.py) does not carry."""
    from transformers import GenerationConfig

    directory = Path(local_dir(pretrained))
    if (directory / "generation_config.json").is_file():
        hf.generation_config = GenerationConfig.from_pretrained(str(directory))


@contextlib.contextmanager
def quiet():
    """transformers' progress bars (writing shards) off: the export says one line."""
    from transformers.utils import logging

    was = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            logging.enable_progress_bar()
