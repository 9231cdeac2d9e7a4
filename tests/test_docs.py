"""The README and docs/ pages: every relative link reaches a file, every #anchor a heading, every page is linked,
every "rule N" and docs/<page>.md#anchor cited in the tree exists, and every command block names what exists."""

import functools
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
DESIGN = ROOT / "docs" / "design.md"
# Where the code, tests and docs cite a page or a rule: comments, docstrings, configs, prose.
CITING = ["src/**/*.py", "scripts/*", "tests/*.py", "conf/**/*.yaml", "docs/*.md", "README.md", "Makefile", ".ci/*"]
RULE = re.compile(r"\brules? (\d+(?:(?:, | and )\d+)*)", re.IGNORECASE)
PAGE_ANCHOR = re.compile(r"(?<![\w/.])((?:\.\./)?(?:docs/)?[\w-]+\.md)#([\w-]+)")
# A README section named in words: README: Launching, README's "Making it yours", README.md (... "The config tree")
README_SECTION = re.compile(r"README(?:\.md|'s)?:? \(?\"?([A-Z][\w ,'-]+)|README\.md [^\"\n]*\(\"([^\"]+)\"\)")


def prose(path: Path) -> list[str]:
    """The lines outside fenced code blocks and HTML comments (neither is rendered as links or headings)."""
    lines, fenced, comment = [], False, False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            line = re.sub(r"<!--.*?-->", "", line)
            if comment:
                comment, line = "-->" not in line, line.partition("-->")[2]
            if "<!--" in line:
                line, comment = line.partition("<!--")[0], True
            lines.append(line)
    return lines


def commands(path: Path) -> list[str]:
    """The command lines of the page's ```bash blocks, continuations joined, comments dropped."""
    out, block, held = [], False, ""
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            block = line.strip() == "```bash" and not block
            continue
        if not block:
            continue
        line = held + re.split(r"(?:^|\s)#(?:\s|$)", line, maxsplit=1)[0].strip()
        held = line[:-1] + " " if line.endswith("\\") else ""
        if line and not held:
            out.append(line)
    return out


@functools.cache
def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but - and _ dropped, spaces to -, repeats numbered."""
    seen: dict[str, int] = {}
    for line in prose(path):
        if m := re.match(r"#{1,6} (.*)", line):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            seen[slug] = seen.get(slug, -1) + 1
    return {slug if n == 0 else f"{slug}-{k}" for slug, n in seen.items() for k in range(n + 1)} | set(seen)


def headings(path: Path) -> list[str]:
    return [m.group(1).strip() for line in prose(path) if (m := re.match(r"#{1,6} (.*)", line))]


def rules(design: Path = DESIGN) -> set[int]:
    """The numbers of design.md's rules: its "### Rule N: ..." headings."""
    return {int(n) for n in re.findall(r"^### Rule (\d+):", design.read_text(), re.MULTILINE)}


def engine_names(root: Path) -> dict[str, str]:
    """trainkit's modules, the search package's and the rooms (the room packages by their __init__.py), each with
    its source. `dist` and `models` are left out: the code also names torch.distributed `dist` and uses
    tokenizers' `models`."""
    package = root / "src" / "trainkit"
    found = {p.stem: p for pattern in ("*.py", "search/*.py") for p in package.glob(pattern)}
    found |= {p.parent.name: p for p in package.glob("*/__init__.py")}
    return {name: path.read_text() for name, path in found.items() if name not in ("dist", "models", "__init__")}


def stale_citations(files: list[Path], root: Path = ROOT) -> list[str]:
    """Each "rule N" that design.md lacks, each docs/<page>.md#anchor whose page or heading is missing, each README
    section named in words that it lacks, and each `module.Class` of trainkit's that the module does not define."""
    known, broken = rules(root / "docs" / "design.md"), []
    modules = engine_names(root)
    qualified = re.compile(r"(?<![\w.])(?:trainkit\.)?(" + "|".join(sorted(modules)) + r")\.([A-Z]\w*)\b")
    for path in files:
        text = path.read_text(errors="replace")
        if ".md#" not in text and "README" not in text and not RULE.search(text) and not qualified.search(text):
            continue
        for i, line in enumerate(text.splitlines(), 1):
            where = f"{path.relative_to(root)}:{i}"
            for group in RULE.findall(line):
                broken += [
                    f"{where}: rule {n} (design.md has no such rule)"
                    for n in re.findall(r"\d+", group)
                    if int(n) not in known
                ]
            for words in (a or b for a, b in README_SECTION.findall(line)):
                if not any(h.startswith(words.strip()) for h in headings(root / "README.md")):
                    broken.append(f"{where}: README section {words.strip()!r} (no such heading)")
            for module, name in qualified.findall(line):
                if not re.search(
                    rf"^(class|def) {name}\b|^{name}\s*[:=]|^from .* import .*\b{name}\b", modules[module], re.M
                ):
                    broken.append(f"{where}: {module}.{name} ({module} defines no {name})")
            for page, anchor in PAGE_ANCHOR.findall(line):
                name = page.rpartition("/")[2]
                dest = root / (name if name == "README.md" else f"docs/{name}")
                if not dest.exists():
                    broken.append(f"{where}: {page}#{anchor} (no such page)")
                elif anchor not in anchors(dest):
                    broken.append(f"{where}: {page}#{anchor} (no such heading)")
    return broken


def citing_files(root: Path = ROOT) -> list[Path]:
    return sorted({p for pattern in CITING for p in root.glob(pattern) if p.is_file() and p.name != "test_docs.py"})


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for page in PAGES:
        for line in prose(page):
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):
                    continue  # http(s), mailto
                file, _, anchor = target.partition("#")
                dest = (page.parent / file).resolve() if file else page
                if not dest.exists():
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
                elif anchor and anchor not in anchors(dest):
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_readme_links_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    assert len(PAGES) > 1
    for page in PAGES[1:]:
        assert f"](docs/{page.name})" in readme, page.name


def test_the_readme_and_train_py_stay_short():
    """A newcomer reads both whole: the README at most 20,000 bytes (details go to docs/), src/train.py at most 300
    lines (a concern that grows moves to its module; issue 58)."""
    assert len((ROOT / "README.md").read_bytes()) <= 20_000
    assert len((ROOT / "src" / "train.py").read_text().splitlines()) <= 300


def test_every_rule_and_page_anchor_the_tree_cites_exists():
    assert rules() == set(range(1, len(rules()) + 1)) and len(rules()) >= 20  # numbered 1..N, none missing
    files = citing_files()
    assert ROOT / "src" / "trainkit" / "coupled.py" in files and DESIGN in files
    broken = stale_citations(files)
    assert not broken, "\n".join(broken)


def test_a_stale_citation_is_caught(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "design.md").write_text("# Design\n\n### Rule 1: one\n\n### Rule 2: two\n")
    (tmp_path / "docs" / "x.md").write_text("# X\n\n## A heading\n")
    (tmp_path / "README.md").write_text("# T\n\n## Launching\n")
    (tmp_path / "src" / "trainkit" / "data").mkdir(parents=True)
    (tmp_path / "src" / "trainkit" / "loading.py").write_text("class TrainBatches:\n    pass\n")
    (tmp_path / "src" / "trainkit" / "data" / "__init__.py").write_text("")
    code = tmp_path / "code.py"
    code.write_text(
        "# rules 1, 2 hold (docs/x.md#a-heading; README: Launching; loading.TrainBatches)\n"
        "# rule 3; docs/x.md#gone; docs/y.md#a; rules 2 and 7; README: Searching; data.TrainBatches\n"
    )
    assert stale_citations([code], tmp_path) == [
        "code.py:2: rule 3 (design.md has no such rule)",
        "code.py:2: rule 7 (design.md has no such rule)",
        "code.py:2: README section 'Searching' (no such heading)",
        "code.py:2: data.TrainBatches (data defines no TrainBatches)",
        "code.py:2: docs/x.md#gone (no such heading)",
        "code.py:2: docs/y.md#a (no such page)",
    ]


def _overrides(args: list[str]) -> list[str]:
    """A command's Hydra overrides: flags dropped, a sweep's first value, placeholders (<...>, ...) left out."""
    out, skip = [], False
    for arg in args:
        if skip or arg in ("-m", "--multirun", "--help", "--resolve"):
            skip = False
            continue
        if arg == "--cfg":
            skip = True
            continue
        if "=" not in arg or "<" in arg or arg.endswith("..."):
            continue
        key, _, value = arg.partition("=")
        if "," in value and value[0] not in "[('\"":
            value = value.split(",")[0]  # -m a=1,2,4: the first job
        out.append(f"{key}={value}")
    return out


def _merged(commands: list[tuple[str, list[str]]]) -> list[tuple[list[str], list[str]]]:
    """Commands grouped so that no key is set twice in a group: one compose checks a whole group."""
    groups: list[tuple[list[str], dict[str, str]]] = []
    for where, overrides in commands:
        keys = dict(o.split("=", 1) for o in overrides)
        group = next((g for g in groups if all(g[1].get(k, v) == v for k, v in keys.items())), None)
        if group is None:
            groups.append(group := ([], {}))
        group[0].append(where)
        group[1].update(keys)
    return [(wheres, [f"{k}={v}" for k, v in keys.items()]) for wheres, keys in groups]


def test_every_command_block_names_scripts_targets_and_options_that_exist():
    """Each command of every ```bash block: its script or make target exists, and each group=option it picks
    is one of the group's options (conf/'s yamls and the plugins'); the README's train.py commands compose."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import trainkit.config  # noqa: F401  registers the schema in Hydra's ConfigStore, as train.py's import does

    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.MULTILINE))
    problems, readme = [], []
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        options = GlobalHydra.instance().config_loader().get_group_options
        for page in PAGES:
            for line in commands(page):
                words = shlex.split(line)
                where = f"{page.relative_to(ROOT)}: {line}"
                if words[0] == "make":
                    if words[1] not in targets:
                        problems.append(f"{where} (no make target {words[1]})")
                    continue
                script = next((w for w in words if w.endswith((".py", ".sh"))), None)
                if script is None:
                    if not (ROOT / words[0]).exists():
                        problems.append(f"{where} (no {words[0]})")
                    continue
                if not (ROOT / script).is_file():
                    problems.append(f"{where} (no {script})")
                    continue
                overrides = _overrides(words[words.index(script) + 1 :])
                if script.startswith("src/"):
                    for override in overrides:
                        group, _, option = override.lstrip("+~").partition("=")
                        choices = options(group) if "." not in group else []  # [] for a plain key
                        if choices and option != "null" and option not in choices:
                            problems.append(f"{where} (no option {option} in group {group})")
                    if page.name == "README.md" and script == "src/train.py":
                        readme.append((where, overrides))
        assert len(readme) >= 10
        for wheres, overrides in _merged(readme):
            try:
                compose("train", overrides=overrides, return_hydra_config=True)
            except Exception as e:  # a key that is not in the tree, a value of the wrong type
                problems.append(f"{'; '.join(wheres)} ({type(e).__name__}: {str(e).splitlines()[0]})")
    assert not problems, "\n".join(problems)


def test_the_layout_in_design_md_names_every_engine_module_and_no_missing_file():
    block = DESIGN.read_text().partition("## Layout")[2].split("```")[1]
    named = set(re.findall(r"\b(\w+\.(?:py|sh))\b", block))
    files = {p.name for pattern in ("src/**/*.py", "scripts/*") for p in ROOT.glob(pattern)}
    engine = {p.name for pattern in ("*.py", "search/*.py") for p in (ROOT / "src" / "trainkit").glob(pattern)}
    engine -= {"__init__.py"}
    assert not named - files, f"design.md's layout names files that do not exist: {sorted(named - files)}"
    assert not engine - named, f"design.md's layout lacks engine modules: {sorted(engine - named)}"
