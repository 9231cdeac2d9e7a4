"""model=hf: a Hugging Face transformers model by class (`model.kind`: causal_lm, sequence_classification,
image_classification, or any transformers class name), from `model.pretrained` (a local dir or a Hub id; weights in
safetensors) or a fresh one from `model.config` (a dict with model_type: a tiny Llama, GPT-2, BERT or ViT), with an
optional LoRA adapter through peft (`model.adapter`). The forward hands the task the logits; the loss is the task's
(exact per token or per sample over the global window), never the model's own `labels=` loss.

What the engine reads from it (models/__init__.py): `shard_units`, the model's own `_no_split_modules` (its decoder /
encoder layers: parallel=fsdp's units); `layer_of(name)`, the layer index (embeddings 0, layer i at i + 1, the rest
last: optim.layer_decay); `block_size` (task=lm's decoding); `materialize(device)`, the weights of a model built on
the meta device. model.activation_checkpointing recomputes each layer in backward (trainkit.recompute).

Pretrained weights, never whole on a rank: the model is built on the meta device (shapes only) and its tensors made
where they belong: under parallel=fsdp after sharding, each rank reading only its rows of the safetensors files
(torch.distributed.checkpoint's Hugging Face reader); otherwise at once, on the CPU. What the files do not hold (a new
classification head, a LoRA adapter, the rotary tables a model computes) is initialised the model's own way (its
`_init_weights`; peft's `reset_lora_parameters`) on a CPU copy of just that module, from a generator seeded by the
run's seed: the same values at any world size and parallel mode.
"""

import collections
import copy
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from omegaconf import MISSING, DictConfig, OmegaConf
from torch import nn

from trainkit.data import tokenizer as hf_tokenizer
from trainkit.errors import ConfigError
from trainkit.materialize import deferring
from trainkit.recompute import checkpoint_forward, outermost

KINDS = {
    "causal_lm": "AutoModelForCausalLM",
    "sequence_classification": "AutoModelForSequenceClassification",
    "image_classification": "AutoModelForImageClassification",
}


@dataclass
class Schema:
    """conf/model/hf.yaml's keys and their types."""

    _target_: str = MISSING
    kind: str = "causal_lm"
    pretrained: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    num_labels: int | None = None
    vocab_size: int | None = None
    tokenizer: str | None = None
    adapter: dict[str, Any] | None = None
    activation_checkpointing: bool = False
    attn_implementation: str | None = None


def hf_model(
    kind: str = "causal_lm",
    pretrained: str | None = None,
    config: dict[str, Any] | None = None,
    num_labels: int | None = None,
    vocab_size: int | None = None,
    tokenizer: str | None = None,
    adapter: dict[str, Any] | None = None,
    activation_checkpointing: bool = False,
    attn_implementation: str | None = None,
) -> "HFModel":
    """The model (see the module's docstring); a fresh one draws its initial weights from the run's seed."""
    cls = model_class(kind)
    conf = model_config(pretrained, config, num_labels, tokenizer, vocab_size)
    args: dict[str, Any] = {"dtype": torch.float32}  # trained in fp32; trainer.precision autocasts
    if attn_implementation is not None:
        args["attn_implementation"] = attn_implementation
    if pretrained is None:
        return HFModel(with_adapter(cls.from_config(conf, **args), adapter), activation_checkpointing)
    with torch.device("meta"):  # shapes only: the weights load in materialize
        net = with_adapter(cls.from_config(conf, **args), adapter)
    model = HFModel(net, activation_checkpointing, weights=local_dir(pretrained), seed=torch.initial_seed())
    model.materialize_pending = deferring()  # parallel=fsdp: materialized after sharding (trainkit.parallel.wrap)
    if not model.materialize_pending:
        model.materialize(torch.device("cpu"))
    return model


def model_class(kind: str):
    import transformers

    name = KINDS.get(kind, kind)
    cls = getattr(transformers, name, None)
    if cls is None or not hasattr(cls, "from_config"):
        raise ConfigError(
            f"model.kind={kind} is neither {', '.join(KINDS)} nor a transformers model class (e.g. LlamaForCausalLM)"
        )
    return cls


def model_config(
    pretrained: str | None,
    config: Mapping | None,
    num_labels: int | None = None,
    tokenizer: str | None = None,
    vocab_size: int | None = None,
):
    """The transformers config: the pretrained one (its config.json) or `config`'s model_type, `config`'s keys over
    it; num_labels for a classification head; the tokenizer's special token ids where the config has none (a
    classifier of a decoder reads the last token that is not padding: pad_token_id). vocab_size: a fresh model's
    where `config` has none (the data's)."""
    from transformers import AutoConfig

    keys = plain(config)
    if num_labels is not None:
        keys["num_labels"] = num_labels
    if pretrained is not None and (run := trainkit_run(pretrained)) is not None:  # a finished model=hf run
        node = run.model
        conf = model_config(*(node.get(k) for k in ("pretrained", "config", "num_labels", "tokenizer", "vocab_size")))
        for key, value in keys.items():
            setattr(conf, key, value)
    elif pretrained is not None:
        try:
            conf = AutoConfig.from_pretrained(local_dir(pretrained), **keys)
        except OSError as error:
            raise ConfigError(f"model.pretrained={pretrained}: {_first_line(error)}") from None
    else:
        if "model_type" not in keys:
            raise ConfigError("model.config needs model_type (llama, gpt2, bert, vit, ...) without model.pretrained")
        model_type = keys.pop("model_type")
        if vocab_size is not None:  # the data's (its tokenizer's), where model.config names none
            keys.setdefault("vocab_size", vocab_size)
        try:
            conf = AutoConfig.for_model(model_type, **keys)
        except ValueError as error:
            raise ConfigError(f"model.config.model_type={model_type}: {_first_line(error)}") from None
    conf.use_cache = False  # training and teacher-forced evaluation: no key/value cache to keep
    if tokenizer is not None:
        tok = hf_tokenizer.load(tokenizer, key="model.tokenizer")  # the data room's loader (its one-line errors)
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if getattr(conf, name, None) is None and getattr(tok, name, None) is not None:
                setattr(conf, name, getattr(tok, name))
        if conf.pad_token_id is None:
            conf.pad_token_id = tok.eos_token_id
    return conf


def trainkit_run(name: str):
    """The config of a finished trainkit run of model=hf named as model.pretrained (its .hydra/config.yaml and
    model.pt: a parent run the experiment builds on), else None. Its weights load as a Hugging Face dir's would."""
    path = Path(name).expanduser()
    if (path / "config.json").exists() or not (path / ".hydra" / "config.yaml").is_file():
        return None
    from trainkit import config

    run = cast(DictConfig, OmegaConf.load(path / ".hydra" / "config.yaml"))
    config.typed(run)  # the rooms' resolvers its keys use
    if run.model.get("_target_") != f"{__name__}.hf_model":
        raise ConfigError(f"model.pretrained={name} is a run of {run.model.get('_target_')}, not of model=hf")
    if run.model.get("adapter"):
        raise ConfigError(f"model.pretrained={name} trained a LoRA adapter: its merged export (src/export.py) is one")
    if not (path / "model.pt").is_file():
        raise ConfigError(f"model.pretrained={name} has no model.pt: not a finished training run")
    return run


def local_dir(name: str) -> str:
    """A local dir as it is; a Hub id: its snapshot in the Hugging Face cache (downloaded unless HF_HUB_OFFLINE=1),
    refused in one line naming the id and the cache where it is not there."""
    if Path(name).expanduser().is_dir():
        return str(Path(name).expanduser())
    if name.startswith(("/", "./", "../", "~")) or name.count("/") > 1:  # a path, not a Hub id (owner/name)
        raise ConfigError(f"{name}: no such directory (a Hugging Face dir, a Hub id owner/name, or a model=hf run)")
    from huggingface_hub import constants, snapshot_download

    try:
        return snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"])
    except Exception as error:  # offline and not cached, no such repo, no network: one line, before the run dir
        offline = " (HF_HUB_OFFLINE=1)" if constants.HF_HUB_OFFLINE else ""
        raise ConfigError(
            f"{name} is neither a local dir nor in the Hugging Face cache {constants.HF_HUB_CACHE}{offline}: "
            f"{type(error).__name__}; download it where there is a network (hf download {name}) or "
            "name a dir holding config.json and *.safetensors"
        ) from None


def with_adapter(net: nn.Module, adapter: Mapping | None) -> nn.Module:
    """`net` with a LoRA adapter (peft): {r, alpha, dropout, target_modules}; only the adapter trains."""
    if not adapter:
        return net
    from peft import LoraConfig, get_peft_model

    spec = plain(adapter)
    unknown = set(spec) - {"r", "alpha", "dropout", "target_modules", "modules_to_save"}
    if unknown:
        raise ConfigError(
            f"model.adapter: unknown key {', '.join(sorted(unknown))} (r, alpha, dropout, target_modules, "
            "modules_to_save)"
        )
    lora = LoraConfig(
        r=spec.get("r", 8),
        lora_alpha=spec.get("alpha", 16),
        lora_dropout=spec.get("dropout", 0.0),
        target_modules=spec.get("target_modules"),
        modules_to_save=spec.get("modules_to_save"),
    )
    try:
        with warnings.catch_warnings():  # peft 0.21 asks transformers 5 a deprecated question (a FutureWarning)
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            return get_peft_model(net, lora)
    except ValueError as error:  # target modules not found
        raise ConfigError(f"model.adapter: {_first_line(error)}") from None


def plain(node: Mapping | None) -> dict[str, Any]:
    """A config node (or dict, or None) as a plain dict."""
    value = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
    return dict(cast(Mapping[str, Any], value or {}))


def core(net: nn.Module) -> Any:
    """The transformers model (inside peft's wrapper where there is one)."""
    return net.get_base_model() if hasattr(net, "get_base_model") else net  # type: ignore[operator]


class HFModel(nn.Module):
    """A transformers model whose forward returns the logits: what the task's loss and metrics read. It gets a tensor
    (input_ids, or pixel_values for an image model: its main_input_name) or a dict of the forward's arguments
    (input_ids and attention_mask of padded text)."""

    def __init__(
        self, net: nn.Module, activation_checkpointing: bool = False, weights: str | None = None, seed: int = 0
    ):
        super().__init__()
        self.net = net
        hf = core(net)
        self.input_name = str(hf.main_input_name)
        self.block_size = getattr(hf.config, "max_position_embeddings", None) or getattr(hf.config, "n_positions", 0)
        present = {type(m).__name__ for m in self.modules()}
        self.shard_units = tuple(sorted(set(hf._no_split_modules or ()) & present)) or None
        self._layers = layer_numbers(self, self.shard_units or ())
        self._weights, self._seed = weights, seed
        if weights is not None:  # the untouched skeleton: what materialize initialises the files' gaps from
            self.__dict__["_skeleton"] = copy.deepcopy(net)  # not a submodule: no state, no sharding
        if activation_checkpointing:
            for block in outermost(self, self.shard_units or ()):
                checkpoint_forward(block)

    def forward(self, x):
        inputs: dict[str, Any] = dict(x) if isinstance(x, Mapping) else {self.input_name: x}
        return self.net(**inputs).logits

    def layer_of(self, name: str) -> int:
        return self._layers.get(name, max(self._layers.values(), default=0))

    def materialize(self, device: torch.device) -> None:
        """Make this model's tensors on `device` (its shards under FSDP) and load the pretrained weights: each
        rank reads its own rows of the files; what the files do not hold is initialised as the module says."""
        tied = _tied_holders(self)
        self.to_empty(device=device)
        for holders in tied:  # to_empty makes one new tensor per holder: tie them again
            first = getattr(*holders[0])
            for module, attr in holders[1:]:
                module._parameters[attr] = first
        loaded = _load_files(self, self._weights)
        _initialise_rest(self, loaded)
        self.materialize_pending = False


def layer_numbers(model: nn.Module, unit_classes: tuple[str, ...]) -> dict[str, int]:
    """optim.layer_decay's layer of each parameter: its layer's index + 1 among the repeated units (classes of which
    the model has more than one), 0 before the first (embeddings), the last + 1 after it (final norm, head)."""
    counts = collections.Counter(type(m).__name__ for m in model.modules())
    layers = outermost(model, tuple(c for c in unit_classes if counts[c] > 1))
    index = {id(layer): i + 1 for i, layer in enumerate(layers)}
    prefixes = {name + ".": index[id(m)] for name, m in model.named_modules() if id(m) in index}
    numbers: dict[str, int] = {}
    seen_layer = False
    for name, _ in model.named_parameters():
        layer = next((i for prefix, i in prefixes.items() if name.startswith(prefix)), None)
        seen_layer |= layer is not None
        numbers[name] = layer if layer is not None else (len(layers) + 1 if seen_layer else 0)
    return numbers


def _tied_holders(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """The (module, attribute) pairs holding one parameter, for each parameter held more than once."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for attr, p in module._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((module, attr))
    return [h for h in holders.values() if len(h) > 1]


def file_name(name: str) -> str:
    """A tensor's name in the transformers model's own files: without this wrapper's `net.`, peft's
    `base_model.model.` and `.base_layer`."""
    name = name.removeprefix("net.").removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".")


def _load_files(model: "HFModel", weights: str | None) -> set[str]:
    """Load the safetensors files of `weights` into `model`'s tensors (plain, or this rank's DTensor shards: the
    reader reads those rows alone); returns the names loaded."""
    import torch.distributed.checkpoint as dcp
    from safetensors import safe_open

    if trainkit_run(str(weights)) is not None:  # a parent run's model.pt (whole: it was written whole)
        return _load_run(model, Path(str(weights)) / "model.pt")
    files = sorted(Path(weights or "").glob("*.safetensors"))
    if not files:
        raise ConfigError(f"model.pretrained: no *.safetensors in {weights} (save_pretrained writes them)")
    stored: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt") as opened:
            stored.update(opened.keys())
    prefix = core(model.net).base_model_prefix
    targets: dict[str, torch.Tensor] = {}
    loaded: set[str] = set()
    tensors = list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers()]
    for name, tensor in tensors:
        own = file_name(name)
        for key in (own, f"{prefix}.{own}", own.removeprefix(f"{prefix}.")):
            if key in stored:
                targets[key] = tensor.data if not hasattr(tensor, "to_local") else tensor
                loaded.add(name)
                break
    if not targets:
        raise ConfigError(f"model.pretrained: none of {weights}'s tensors are this model's (model.kind?)")
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    with torch.no_grad(), warnings.catch_warnings():  # no_dist: each rank reads its own rows, no collective
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(targets, storage_reader=HuggingFaceStorageReader(str(weights)), no_dist=True)
    return loaded


def _load_run(model: "HFModel", path: Path) -> set[str]:
    """Load a trainkit run's model.pt (memory-mapped: a rank touches the rows it copies) into `model`'s tensors."""
    state = {file_name(k): v for k, v in torch.load(path, weights_only=True, mmap=True).items()}
    loaded: set[str] = set()
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if (value := state.get(file_name(name))) is not None:
                _copy_rows(tensor, value)
                loaded.add(name)
    return loaded


def _initialise_rest(model: "HFModel", loaded: set[str]) -> None:
    """Every tensor the files did not hold (a new head, an adapter, a computed buffer) initialised the module's own
    way on a CPU copy of its module, drawn in name order from the run's seed, then copied (its rows under FSDP)."""
    skeleton: nn.Module = model.__dict__["_skeleton"]
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    missing = [name for name in tensors if name not in loaded]
    owners = sorted({_owner(skeleton, name.removeprefix("net.")) for name in missing})
    hf = core(skeleton)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(model._seed)
        for owner in owners:
            twin: Any = copy.deepcopy(skeleton.get_submodule(owner) if owner else skeleton).to_empty(device="cpu")
            if hasattr(twin, "reset_lora_parameters"):  # peft's LoRA layer: A random, B zero (starts as the base)
                for adapter in twin.lora_A:
                    twin.reset_lora_parameters(adapter, True)
            else:
                for m in twin.modules():
                    hf._init_weights(m)
            full = dict(twin.named_parameters()) | dict(twin.named_buffers())
            for name, value in full.items():
                ours = f"net.{owner}.{name}" if owner else f"net.{name}"
                if ours in tensors and ours not in loaded:
                    _copy_rows(tensors[ours], value)


def _owner(skeleton: nn.Module, name: str) -> str:
    """The module to initialise `name` with: its own, or the LoRA layer holding it (peft initialises A and B
    together)."""
    owner = name.rsplit(".", 1)[0] if "." in name else ""
    parts = owner.split(".") if owner else []
    for end in range(len(parts), 0, -1):
        if hasattr(skeleton.get_submodule(".".join(parts[:end])), "reset_lora_parameters"):
            return ".".join(parts[:end])
    return owner


def _copy_rows(target: Any, full: torch.Tensor) -> None:
    """Copy the whole tensor `full` into `target`: a plain tensor whole, a DTensor its local shard's part."""
    if hasattr(target, "to_local"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(full.shape, target.device_mesh, target.placements)
        index = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
        target.to_local().copy_(full[index])
    else:
        target.data.copy_(full)


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]


def check(cfg) -> None:
    """Before the run dir: the pretrained model is there (a Hub id offline and not cached: one line), and the data's
    token ids fit the model's embedding. The tokenizer is the data room's to check (data.train_tokenizer may make it
    when the data is prepared)."""
    node = cfg.model
    conf = model_config(
        node.get("pretrained"), node.get("config"), node.get("num_labels"), vocab_size=node.get("vocab_size")
    )
    data_vocab = cfg.data.get("vocab_size")
    model_vocab = getattr(conf, "vocab_size", None)
    if data_vocab is not None and model_vocab is not None and int(data_vocab) > int(model_vocab):
        raise ConfigError(
            f"data.vocab_size={data_vocab} (the data's tokenizer) does not fit the model's embedding of {model_vocab} "
            f"ids (model.pretrained / model.config.vocab_size): the model's own tokenizer (data.tokenizer), or a "
            "config with vocab_size: ${data.vocab_size}"
        )


def check_export(run_cfg, merge: bool) -> None:
    """src/export.py's check of a finished run before it builds the model (models/hf_export.py)."""
    from trainkit.models import hf_export

    hf_export.check_export(run_cfg, merge)


def export(model: HFModel, run_cfg, directory: Path, merge: bool, out: str) -> str:
    """src/export.py's: the run's model as a Hugging Face directory (models/hf_export.py)."""
    from trainkit.models import hf_export

    return hf_export.export(model, run_cfg, directory, merge, out)
