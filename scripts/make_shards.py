"""Write a data set of the tree as a shard set for data=shards (the format: src/trainkit/data/shards.py):

    python scripts/make_shards.py data=<name> [data.<key>=...] out=<dir|s3://...> [shard_size=64MB] [max_count=N]
        [splits=train,val,test] [seed=0] [shuffle=true] [overwrite=false]

The data config is composed from conf/ as a training run composes it (data=<name> and its keys, and any other override:
task=... where a data set leaves it open); its splits are built and written: an image folder's images as their files'
bytes (its transforms run when read), any other sample as its tensors. A train split that draws its samples at random
each epoch is refused; where the data config has `random_offsets` (data=tokens, pydoc_text) it is set to false first
(tiles: every token a target once) and said so. The train split is written in a seeded random order (seed, shuffle),
so a shard is a random sample of it; val and test in their order. shard_size: a shard closes past this many bytes of
samples (64MB, 1GB, ...); max_count: or this many samples. An `out` that holds files is refused without overwrite=true.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

CONF = Path(__file__).resolve().parent.parent / "conf"
OWN = {  # this script's keys and their defaults; every other key=value is an override of the composed config
    "out": None,
    "shard_size": "64MB",
    "max_count": 100000,
    "splits": "train,val,test",
    "seed": 0,
    "shuffle": True,
    "overwrite": False,
}


def _value(key: str, text: str):
    if isinstance(OWN[key], bool):
        if text.lower() not in ("true", "false"):
            raise ValueError(f"{key}={text} must be true or false")
        return text.lower() == "true"
    if isinstance(OWN[key], int):
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{key}={text} must be an integer") from None
    return text


def parse(argv: list[str]) -> tuple[dict, list[str]]:
    """(this script's settings, the config's overrides) of key=value arguments."""
    settings, overrides = dict(OWN), []
    for arg in argv:
        key, eq, text = arg.partition("=")
        if not eq:
            raise ValueError(f"{arg}: arguments are key=value (data=<name>, out=<dir|url>, ...)")
        if key in OWN:
            settings[key] = _value(key, text)
        else:
            overrides.append(arg)
    return settings, overrides


def main(argv: list[str] | None = None, progress: bool = True) -> int:
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from hydra.utils import instantiate
    from omegaconf import open_dict

    from trainkit import config, heldout, options
    from trainkit.data import shard_writer
    from trainkit.data.shard_store import parse_size
    from trainkit.errors import ConfigError, user_error

    try:
        settings, overrides = parse(sys.argv[1:] if argv is None else argv)
        if settings["out"] is None:
            raise ConfigError("out is required: python scripts/make_shards.py data=<name> out=<dir|url>")
        wanted = [s for s in settings["splits"].split(",") if s]
        if unknown := [s for s in wanted if s not in heldout.SPLITS]:
            raise ConfigError(f"splits={settings['splits']}: {unknown[0]} is not one of {', '.join(heldout.SPLITS)}")
        if settings["max_count"] < 1:
            raise ConfigError(f"max_count={settings['max_count']} must be >= 1")
        shard_size = parse_size(settings["shard_size"])
        shard_writer.refuse_existing(settings["out"], settings["overwrite"])
        try:
            with initialize_config_dir(str(CONF), version_base="1.3"):
                cfg = compose("train", overrides=overrides, return_hydra_config=True)
        except HydraException as error:  # as train.py says it (data=nope is not one of: ...)
            raise ConfigError(config._one_line(error) or " ".join(str(error).split("\n")[0].split())) from None
        task = cfg.hydra.runtime.choices.get("task")
        with open_dict(cfg):
            del cfg["hydra"]
            if "random_offsets" in cfg.data:  # random blocks would be drawn once and fixed: tiles instead
                cfg.data.random_offsets = False
                print(
                    f"make_shards: data.random_offsets=false (data={cfg.data.name}'s train split as tiles: every "
                    "token a target once)"
                )
        config.typed(cfg)  # the data set's schema, and its module's resolvers
        if (check := getattr(options.module_of(cfg, "data"), "check", None)) is not None:
            check(cfg)
        sets = heldout.unpack(instantiate(cfg.data.splits), cfg.data.name)
        manifest = shard_writer.write(
            cfg,
            task,
            sets,
            settings["out"],
            shard_size,
            settings["max_count"],
            wanted,
            settings["seed"],
            settings["shuffle"],
            settings["overwrite"],
            progress,
        )
    except (ValueError, ConfigError) as error:
        known = user_error(error) if not isinstance(error, ConfigError) else error
        print(f"error: {known or error}", file=sys.stderr)
        return 2
    except Exception as error:  # instantiate wraps a data set's own refusal
        known = user_error(error)
        if known is None:
            raise
        print(f"error: {known}", file=sys.stderr)
        return 2
    said = ", ".join(
        f"{split} {info['samples']} samples in {len(info['shards'])} shards "
        f"({sum(s['bytes'] for s in info['shards']) / 1e6:.1f} MB)"
        for split, info in manifest["splits"].items()
    )
    print(f"make_shards: wrote {settings['out']} from data={cfg.data.name} (task={task}): {said}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
