"""src/export.py: a finished model=hf run as a Hugging Face directory. A tiny Llama (save_pretrained into a temp dir,
and into a Hugging Face cache made here, as a Hub id) trained 2 SGD steps on data=addition, plain and with a LoRA
adapter; exported, transformers' (or peft's) from_pretrained gives the run's logits on a batch (fp32, 1e-6): the
plain model, the adapter merged, the adapter alone on its base (the Hub id the run named). The tokenizer travels with
it; what cannot be exported is refused in one line, nothing written. All offline: every model and tokenizer is made
here."""

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from helpers import cli_in_process, run_in_process
from hf_tiny import tiny_llama

transformers = pytest.importorskip("transformers")

RUN = ["data=addition", "data.num_train=32", "data.num_val=16", "data.batch_size=8", "logger=none"]
RUN += ["optim=sgd", "optim.lr=0.5", "trainer.max_steps=2", "trainer.eval_every=100", "checkpoint.monitor=null"]
LORA = ["+model.adapter={r:4,alpha:8,target_modules:[q_proj,v_proj]}"]
EXACT = dict(atol=1e-6, rtol=0)  # fp32, the bound; measured: 0 plain and adapter, 1.2e-7 merged (W + BA)


HUB_ID = "trainkit-test/tiny-llama"  # the LoRA run's model.pretrained: a Hub id, found in a local cache offline


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """A Hugging Face cache made here (offline: a Hub id resolves to its snapshot there, never a download)."""
    from huggingface_hub import constants

    cache = tmp_path_factory.mktemp("hf_cache") / "hub"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(constants, "HF_HUB_OFFLINE", True)
        patch.setattr(constants, "HF_HUB_CACHE", str(cache))
        yield cache


@pytest.fixture(scope="module")
def runs(hub_cache, tmp_path_factory) -> dict[str, Path]:
    """The tiny Llama's dir ("base", also in the cache as HUB_ID) and its finished runs: plain (model.pretrained the
    dir), LoRA (model.pretrained the Hub id) and a model=gpt run (not model=hf)."""
    from trainkit.data.addition import VOCAB

    root = tmp_path_factory.mktemp("hf_export")
    tiny_llama(root / "base", len(VOCAB))  # tied embeddings: save_pretrained stores the head once, the export keeps it
    repo = hub_cache / f"models--{HUB_ID.replace('/', '--')}"
    shutil.copytree(root / "base", repo / "snapshots" / ("0" * 40))  # the cache's layout: a snapshot and its ref
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    run_in_process(root / "plain", "model=hf", f"model.pretrained={root / 'base'}", *RUN)
    run_in_process(root / "lora", "model=hf", f"model.pretrained={HUB_ID}", *LORA, *RUN)
    run_in_process(root / "gpt", "model=gpt", "model.n_layer=1", "model.n_embd=16", *RUN)
    return {"base": root / "base", **{name: root / name for name in ("plain", "lora", "gpt")}}


def export(run_dir: Path, out: Path, *overrides: str, job: Path | None = None) -> str:
    """What `python src/export.py run_dir=... out=...` prints; its own job dir (provenance.json) beside `out`."""
    job = job or out.with_name(f"{out.name}_job")
    return run_in_process(job, f"run_dir={run_dir}", f"out={out}", *overrides, script="export")


def batch() -> torch.Tensor:
    return torch.randint(0, 14, (4, 11), generator=torch.Generator().manual_seed(0))


def run_logits(run_dir: Path, x: torch.Tensor) -> torch.Tensor:
    """The run's own model (its config, model.pt), as predict.py and eval.py rebuild it."""
    from trainkit.rundir import load_run_config, run_model

    cfg = OmegaConf.create({"run_dir": str(run_dir), "weights": "last"})
    model, _ = run_model(cfg, load_run_config(cfg, "test"))
    with torch.no_grad():
        return model.eval()(x)


def logits(model, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=x).logits


def test_export_loads_with_from_pretrained_and_gives_the_runs_logits(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    out, x = tmp_path / "hf" / "plain", batch()  # hf/ is made for it
    line = export(runs["plain"], out, job=tmp_path / "job").strip()
    assert "\n" not in line and f"AutoModelForCausalLM.from_pretrained('{out}')" in line, line
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["use_cache"] is True  # off for training only
    expected = run_logits(runs["plain"], x)
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(out), x), expected, **EXACT)
    # the run's trained weights, not the pretrained ones it started from
    assert (logits(AutoModelForCausalLM.from_pretrained(runs["base"]), x) - expected).abs().max() > 1e-3
    (out / "stale.txt").write_text("from an earlier export")
    export(runs["plain"], out, "overwrite=true", job=tmp_path / "job2")  # replaced whole
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").is_file()
    assert [p.name for p in out.parent.iterdir()] == ["plain"]  # no temp dir left beside it


def test_a_lora_run_exports_merged_and_as_the_adapter_alone(runs, tmp_path):
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    x = batch()
    expected = run_logits(runs["lora"], x)
    assert (logits(AutoModelForCausalLM.from_pretrained(runs["base"]), x) - expected).abs().max() > 1e-4  # trained
    export(runs["lora"], tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    with safe_open(str(tmp_path / "merged" / "model.safetensors"), framework="pt") as f:
        assert not [k for k in f.keys() if "lora" in k or "base_layer" in k]  # noqa: SIM118  a plain model
    assert type(merged) is LlamaForCausalLM
    torch.testing.assert_close(logits(merged, x), expected, **EXACT)

    line = export(runs["lora"], tmp_path / "adapter", "merge=false")
    assert f"for the base model.pretrained={HUB_ID}" in line
    assert f"PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained('{HUB_ID}'), " in line
    files = {p.name for p in (tmp_path / "adapter").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files and "model.safetensors" not in files
    adapter_config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == HUB_ID  # as the run named it, not the cache's path
    with warnings.catch_warnings():  # peft 0.21 asks transformers 5 a deprecated question
        warnings.simplefilter("ignore", FutureWarning)
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(HUB_ID), tmp_path / "adapter")
    torch.testing.assert_close(logits(model, x), expected, **EXACT)


def test_the_tokenizer_is_written_beside_the_model(runs, tmp_path):
    """model.tokenizer (the data's data.tokenizer) goes into the directory: AutoTokenizer loads it from there."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from trainkit.data.addition import VOCAB
    from trainkit.models.hf import hf_model
    from trainkit.models.hf_export import export as hf_export

    made = Tokenizer(models.WordLevel({c: i for i, c in enumerate(VOCAB)}, unk_token="."))  # a character each
    made.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=made, pad_token=".", eos_token="$")
    tok.save_pretrained(tmp_path / "tok")
    node = {"kind": "causal_lm", "pretrained": str(runs["base"]), "adapter": None, "tokenizer": str(tmp_path / "tok")}
    run_cfg = OmegaConf.create({"model": node})
    (tmp_path / "out").mkdir()
    line = hf_export(hf_model(pretrained=str(runs["base"])), run_cfg, tmp_path / "out", True, "out")
    assert f"the tokenizer {tmp_path / 'tok'}" in line
    loaded = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert loaded("12+34=")["input_ids"] == [VOCAB.index(c) for c in "12+34="] and loaded.eos_token == "$"


def _broken_copy(run: Path, where: Path, case: str) -> Path:
    """A copy of a finished run: without model.pt (training not finished), or with one base tensor changed."""
    shutil.copytree(run, where)
    if case == "no_model":
        (where / "model.pt").unlink()
    else:
        state = torch.load(where / "model.pt", weights_only=True)
        state["net.base_model.model.model.layers.0.mlp.up_proj.weight"][0, 0] += 1.0  # as model.init would
        torch.save(state, where / "model.pt")
    return where


REFUSALS = {
    "not_hf": "declares no export; export.py writes model=hf runs as Hugging Face directories",
    "no_model": "has no model.pt: not a finished training run",
    "not_empty": "exists and holds files: another dir, or overwrite=true to replace it",
    "merge_false_no_adapter": "merge=false writes a LoRA adapter alone, and this run has none (model.adapter is null)",
    "base_differs": "merge=false: the run's base weights are not model.pretrained=",
    "replaces_run": "would replace the run dir",
}


@pytest.mark.parametrize("case", REFUSALS)
def test_what_cannot_be_exported_is_one_line_and_nothing_written(runs, tmp_path, capfd, case):
    out = tmp_path / "new" / "out"  # its parent is made only for an export that goes on
    run = {"no_model": "plain", "base_differs": "lora", "not_hf": "gpt"}.get(case, "plain")
    run_dir = _broken_copy(runs[run], tmp_path / "run", case) if case in ("no_model", "base_differs") else runs[run]
    given = {"merge_false_no_adapter": "merge=false", "base_differs": "merge=false", "replaces_run": "overwrite=true"}
    overrides = [f"run_dir={run_dir}", *([given[case]] if case in given else [])]
    if case == "not_empty":
        out.mkdir(parents=True)
        (out / "keep.txt").write_text("mine")
    if case == "replaces_run":
        out = runs["plain"]
    before = sorted(p.name for p in out.iterdir()) if out.exists() else None
    job = tmp_path / "job"
    proc = cli_in_process(capfd, job, *overrides, f"out={out}", script="export")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert REFUSALS[case] in lines[0]
    assert not job.exists()  # the job's dir, which Hydra made, goes too
    if before is None:
        assert not out.parent.exists()
    else:
        assert sorted(p.name for p in out.iterdir()) == before


def test_torchrun_is_refused(runs, tmp_path, monkeypatch):
    from trainkit.errors import ConfigError

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match="export.py runs on one process"):
        export(runs["plain"], tmp_path / "out")
    assert not (tmp_path / "out").exists()
