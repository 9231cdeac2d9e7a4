"""parallel=fsdp's units with no extra keys: every built-in model shards, a model of one's own with a
ModuleList too, and a unit that cannot be sharded is one line naming it."""

import pytest
import torch
from torch import nn

from helpers import max_diff, rows, run_in_process, weights
from trainkit.config import ConfigError
from trainkit.models.cnn import cnn
from trainkit.models.gpt import gpt
from trainkit.models.mlp import mlp
from trainkit.models.resnet import resnet18
from trainkit.parallel import fsdp_units


def kinds(units: list[nn.Module]) -> list[str]:
    return [type(m).__name__ for m in units]


def test_every_built_in_model_gets_sensible_units_by_default():
    assert kinds(fsdp_units(mlp((1, 8, 8), 10, depth=2))) == ["Linear"] * 3
    assert kinds(fsdp_units(cnn(1, 10))) == ["Conv2d", "BatchNorm2d"] * 3 + ["Linear"]
    assert kinds(fsdp_units(resnet18(3, 10))) == ["Conv2d", "BatchNorm2d", *["Sequential"] * 4, "Linear"]
    model = gpt(vocab_size=14, block_size=16, n_layer=3)
    assert fsdp_units(model) == list(model.blocks)  # the model names its units: one per Block


class Stack(nn.Module):
    """A model of one's own: its layers in a ModuleList (no forward of its own), the head tied to
    the embedding."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.norms = nn.ModuleDict({"final": nn.LayerNorm(8)})
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norms["final"](x))


def test_containers_are_looked_into_and_tied_weights_stay_in_the_root():
    model = Stack()
    assert fsdp_units(model) == [*model.layers, model.norms["final"]]
    # Without its own naming the GPT is cut the same way: embedding and head (tied) in the root.
    plain = gpt(vocab_size=14, block_size=16, n_layer=2)
    plain.shard_units = None  # an instance attribute: the class's naming ignored
    assert fsdp_units(plain) == [plain.wpe, *plain.blocks, plain.ln_f]


def test_a_unit_that_cannot_be_sharded_is_one_line_naming_it():
    with pytest.raises(ConfigError) as error:
        fsdp_units(gpt(vocab_size=14, block_size=16), ["ModuleList"])
    message = str(error.value)
    assert message == (
        "parallel.shard_units: blocks (ModuleList) cannot be sharded: a container without a forward "
        "of its own; name the classes it holds (Block)"
    )


# The GPT under parallel=fsdp with no extra keys: 2 ranks x b=8 against one process x b=16, two SGD
# steps. SGD's update is lr x gradient: the runs differ by the gradient's reduction-order rounding
# alone. (AdamW's m / (sqrt(v) + eps) turned that rounding of a near-zero gradient into a jump of up
# to lr: 5.2e-5 on one of 103,424 weights on a second machine, DDP alike.)
TINY_GPT = [
    "+experiment=addition_gpt",
    "data.num_train=64",
    "data.num_val=8",
    "model.n_layer=2",
    "optim=sgd",
    "optim.lr=0.1",
    "trainer.max_steps=2",
    "trainer.log_every=1",
    "checkpoint.every=0",
    "sched.warmup_steps=0",  # full lr from the first step: the weights move far above the tolerance
]


def test_the_gpt_shards_with_no_extra_keys_and_equals_one_process(tmp_path):
    run_in_process(tmp_path / "single", *TINY_GPT, "data.batch_size=16")
    run_in_process(tmp_path / "fsdp", *TINY_GPT, "data.batch_size=8", "parallel=fsdp", nproc=2)
    single, fsdp = weights(tmp_path / "single"), weights(tmp_path / "fsdp")
    assert single.keys() == fsdp.keys() == gpt(vocab_size=14, block_size=24).state_dict().keys()
    torch.manual_seed(0)  # train.py seeds the init the same way
    initial = gpt(vocab_size=14, block_size=24).state_dict()
    print(f"max |FSDP - single| {max_diff(fsdp, single):.2e}, max |single - init| {max_diff(single, initial):.2e}")
    for key in single:
        # SGD: the runs differ by reduction-order rounding (3.7e-9 measured); 1e-6 is 270x that, and one
        # Block reduce-scattered in bf16 (a planted bug) is 9.8e-5 off. (2 AdamW steps: 3.6e-5 on 15 weights.)
        torch.testing.assert_close(fsdp[key], single[key], rtol=0, atol=1e-6, msg=key)
    # The Blocks and the root: one reduce-scatter round a step.
    assert rows(tmp_path / "fsdp")[-1]["comm/grad_syncs"] == 1.0
