"""The README and the docs/ pages stay true: what they name exists, what they show runs or validates.

Fast: nothing loads a model. Conventions for writing the pages:

- A YAML snippet is a fragment, validated against the config schema merged onto the shipped config its first
  lines name, ``# a fragment: these keys on top of recipes/configs/X.yaml``; without one, onto the default
  (``recipes/configs/grpo_arithmetic_cpu.yaml``). ``# world_size: N`` sets the world size it is checked
  for (default 2, the main job's).
- A shell command (a fenced ``bash`` block, or an inline code span starting with ``python`` or
  ``torchrun``) is checked in full: the script exists; a recipe command's config, overrides and flags
  validate as the recipe would validate them; a tool's flags parse with its own argparse parser;
  torchrun's flags parse with torchrun's. Write whole commands, not ``...`` abbreviations.
- An inline code span that is a config key (``actor.lr``, ``trainer.checkpoint.resume: auto``) must name a key the
  schema has; one that is a ``torchrlhf.`` dotted name must import.
- Paths under recipes/, tools/, tests/, docs/ and torchrlhf/ must exist.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DEFAULT_CONFIG = "recipes/configs/grpo_arithmetic_cpu.yaml"
SECTIONS = ("data", "rollout", "algorithm", "actor", "critic", "ref", "teacher", "reward", "reward_model", "cost_model",
            "placement", "trainer", "async_training")
PARSE_TOOL_ARGS = Path(__file__).with_name("parse_tool_args.py")


@dataclass(frozen=True)
class Block:
    page: str
    lang: str
    text: str
    line: int

    def where(self) -> str:
        return f"{self.page}:{self.line}"


def _blocks() -> list[Block]:
    found = []
    for page in PAGES:
        text = page.read_text()
        for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M):
            found.append(Block(page.name, m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1))
    return found


def _inline_spans() -> list[tuple[str, str]]:
    """(page, span) of every inline code span outside fenced blocks."""
    spans = []
    for page in PAGES:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
        spans += [(page.name, s) for s in re.findall(r"`([^`\n]+)`", text)]
    return spans


BLOCKS = _blocks()


def _commands() -> list[tuple[str, list[str]]]:
    """(where, argv) of every shell command: bash blocks (continuations joined) and inline python/torchrun spans."""
    found = []
    for b in BLOCKS:
        if b.lang != "bash":
            continue
        for line in b.text.replace("\\\n", " ").splitlines():
            found += [(b.where(), argv) for argv in _split(line)]
    for page, span in _inline_spans():
        if re.match(r"^(\w+=\S+ )*(python|torchrun) .*\.py\b", span):  # a command, not `torchrun --max-restarts`
            found += [(page, argv) for argv in _split(span)]
    return found


def _split(line: str) -> list[list[str]]:
    tokens = shlex.split(line, comments=True)
    commands, current = [], []
    for tok in tokens:
        if tok in ("&&", ";", "||", "|"):
            commands.append(current)
            current = []
        else:
            current.append(tok)
    commands.append(current)
    out = []
    for argv in commands:
        while argv and re.match(r"^[A-Z_]+=", argv[0]):  # OMP_NUM_THREADS=1 python ...
            argv = argv[1:]
        if argv:
            out.append(argv)
    return out


COMMANDS = _commands()


# ---------------------------------------------------------------------------- a sandbox for config loading
@pytest.fixture(scope="module")
def sandbox(tmp_path_factory) -> Path:
    """A working directory like the repository root after tools/prepare_gsm8k.py: data stand-ins."""
    root = tmp_path_factory.mktemp("cwd")
    for name in ("recipes", "tools", "tests", "docs"):
        (root / name).symlink_to(ROOT / name)
    gsm8k = root / "data" / "gsm8k"
    gsm8k.mkdir(parents=True)
    for split in ("train", "test"):
        (gsm8k / f"gsm8k_{split}.jsonl").write_text('{"prompt": "1+1?", "ground_truth": "2"}\n')
    return root


def _recipe_cli():
    spec = importlib.util.spec_from_file_location("ppo_recipe", ROOT / "recipes" / "ppo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _torchrun_world(args: list[str]) -> tuple[int, list[str]]:
    """Parse torchrun's own flags with torchrun's parser: (world size, the script's argv)."""
    from torch.distributed.run import get_args_parser

    ns = get_args_parser().parse_args(args)
    nnodes = max(int(n) for n in str(ns.nnodes).split(":"))
    nproc = int(ns.nproc_per_node) if str(ns.nproc_per_node).isdigit() else 1
    return nnodes * nproc, [ns.training_script, *ns.training_script_args]


def _check_recipe(where: str, args: list[str], world: int | None) -> None:
    from torchrlhf.trainer.run import load

    if "--help" in args or "-h" in args or "--calibrate" in args:
        return
    ppo = _recipe_cli()
    rest, flags = ppo._take_flags(args)
    flag_world = flags.get("--world-size")
    path, overrides = ppo.parse_args(rest)
    # a placeholder for the user's own model (/path/to/Qwen2.5-7B-Instruct): a directory that exists; for a
    # distillation teacher (exported from a SmolLM2 run), a model with the student's tokenizer
    overrides = [re.sub(r"^teacher\.model_path=/path/to/\S+", "teacher.model_path=smollm2", o) for o in overrides]
    overrides = [re.sub(r"=/path/to/\S+", f"={os.getcwd()}", o) for o in overrides]
    load(path, overrides, flag_world or world or 1)  # raises ConfigError naming what is wrong


def _script_and_args(argv: list[str]) -> tuple[str | None, list[str], int | None]:
    """(script, its args, torchrun world size or None) of a python/torchrun command; script None if other."""
    if argv[0] == "torchrun":
        world, script_argv = _torchrun_world(argv[1:])
        return script_argv[0], script_argv[1:], world
    if argv[0] == "python":
        if argv[1:3] == ["-m", "pytest"]:
            return "pytest", argv[3:], None
        if argv[1] == "-m":
            return None, [], None
        return argv[1], argv[2:], None
    return None, [], None


def test_commands_are_whole():
    abbreviated = [(where, " ".join(argv)) for where, argv in COMMANDS if "..." in argv]
    assert not abbreviated, f"write whole commands, not '...': {abbreviated}"


def test_recipe_commands_validate(sandbox, monkeypatch):
    """Every recipe command's config, overrides and flags validate, as the recipe checks them before it loads."""
    monkeypatch.chdir(sandbox)
    checked = 0
    for where, argv in COMMANDS:
        try:
            script, args, world = _script_and_args(argv)
        except SystemExit:  # torchrun's parser printed why
            pytest.fail(f"{where}: `{' '.join(argv)}`: torchrun does not take these flags")
        if script == "recipes/ppo.py":
            try:
                _check_recipe(where, args, world)
            except (Exception, SystemExit) as e:
                pytest.fail(f"{where}: `{' '.join(argv)}`: {type(e).__name__}: {e}")
            checked += 1
    assert checked >= 10, f"only {checked} recipe commands found: is the extraction broken?"


def test_tool_commands_parse():
    """Every tools/ (and other script) command: the file exists and its own argparse parser takes the flags."""
    calls, missing = [], []
    for where, argv in COMMANDS:
        script, args, _ = _script_and_args(argv)
        if script is None or script in ("pytest", "recipes/ppo.py"):
            continue
        if not (ROOT / script).is_file():
            missing.append(f"{where}: {script}")
        else:
            calls.append([where, script, args])
    assert not missing, f"scripts named in the docs that do not exist: {missing}"
    assert len({c[1] for c in calls}) >= 8, calls
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, str(PARSE_TOOL_ARGS)], input=json.dumps(calls), capture_output=True,
                       text=True, cwd=ROOT, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    failures = [f"{where}: `{script} {' '.join(args)}`: {problem}" for where, script, args, problem in
                json.loads(p.stdout.splitlines()[-1]) if problem]
    assert not failures, "\n".join(failures)


def test_pytest_commands_name_existing_tests():
    named = [(where, a) for where, argv in COMMANDS if _script_and_args(argv)[0] == "pytest"
             for a in _script_and_args(argv)[1] if not a.startswith("-")]
    assert named, "no pytest command found"
    missing = [(where, a) for where, a in named if not (ROOT / a.split("::")[0]).exists()]
    assert not missing, missing


def test_paths_exist():
    pattern = re.compile(r"(?<![\w/.~-])((?:recipes|tools|tests|docs|torchrlhf)/[\w./-]*\w)")
    missing = []
    for page in [*PAGES, ROOT / "CHANGELOG.md"]:
        for path in set(pattern.findall(page.read_text())):
            if not (ROOT / path).exists():
                missing.append(f"{page.name}: {path}")
    assert not missing, f"paths named in the docs that do not exist: {sorted(missing)}"


def _snippet_config(block: Block) -> tuple[OmegaConf, int]:
    base_file = re.search(r"^#\s*a fragment: these keys on top of\s+(\S+)", block.text, flags=re.M)
    world = re.search(r"^#\s*world_size:\s*(\d+)", block.text, flags=re.M)
    base = OmegaConf.load(ROOT / (base_file.group(1) if base_file else DEFAULT_CONFIG))
    return OmegaConf.merge(base, OmegaConf.create(block.text)), int(world.group(1)) if world else 2


YAML_BLOCKS = [b for b in BLOCKS if b.lang == "yaml"]


@pytest.mark.parametrize("block", YAML_BLOCKS, ids=[b.where() for b in YAML_BLOCKS])
def test_yaml_snippet_validates(block, sandbox, monkeypatch):
    from torchrlhf.trainer.run import load

    monkeypatch.chdir(sandbox)
    cfg, world = _snippet_config(block)
    load(cfg, [], world)  # ConfigError lists every problem


PY_BLOCKS = [b for b in BLOCKS if b.lang == "python"]


@pytest.mark.parametrize("block", PY_BLOCKS, ids=[b.where() for b in PY_BLOCKS])
def test_python_snippet_imports_what_it_names(block):
    tree = ast.parse(block.text)
    imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert imports, f"{block.where()}: a Python snippet that imports nothing"
    for node in imports:
        if isinstance(node, ast.Import):
            for alias in node.names:
                importlib.import_module(alias.name)
        else:
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{block.where()}: {node.module} has no {alias.name}"


def _resolve(dotted: str) -> None:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return
    raise ImportError(dotted)


def test_dotted_names_import():
    names = {span for _, span in _inline_spans() if re.fullmatch(r"torchrlhf(\.\w+)+", span)}
    assert names, "no torchrlhf.* names found"
    broken = []
    for name in sorted(names):
        try:
            _resolve(name)
        except (ImportError, AttributeError) as e:
            broken.append(f"{name} ({type(e).__name__}: {e})")
    assert not broken, broken


def _schema_keys(cfg, prefix: str = "") -> set[str]:
    keys = set()
    for f in dataclasses.fields(cfg):
        key = f"{prefix}{f.name}"
        keys.add(key)
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            keys |= _schema_keys(value, key + ".")
    return keys


@pytest.fixture(scope="module")
def schema_keys(sandbox) -> set[str]:
    """Every config key of the shipped configs' schemas (critic, reward and cost models, both engines)."""
    from torchrlhf.trainer.run import load

    cwd = os.getcwd()
    os.chdir(sandbox)
    try:
        keys = set()
        for path, overrides, world in [
            (DEFAULT_CONFIG, [], 2),
            (DEFAULT_CONFIG, ["rollout.engine._component_=torchrlhf.generation.VLLMEngine"], 2),
            ("recipes/configs/ppo_gsm8k_smollm2.yaml", [], 2),
            ("recipes/configs/safe_rlhf_example.yaml", [], 2),
            ("recipes/configs/grpo_calculator_agent_cpu.yaml", [], 1),
            ("recipes/configs/distill_calculator_agent_cpu.yaml", ["teacher.model_path=smollm2"], 1),
        ]:
            keys |= _schema_keys(load(path, overrides, world)[0])
        return keys
    finally:
        os.chdir(cwd)


def test_config_keys_named_in_prose_exist(schema_keys):
    """`actor.lr`, `trainer.checkpoint.resume: auto`, `rollout.engine._component_`: a renamed key breaks this test."""
    pattern = re.compile(rf"({'|'.join(SECTIONS)})\.([\w.]+?)(?:\s*[=:].*)?")
    named = {(page, m.group(1) + "." + m.group(2)) for page, span in _inline_spans()
             if (m := pattern.fullmatch(span))}
    assert len(named) >= 30, f"only {len(named)} config keys found in the prose: is the extraction broken?"
    unknown = sorted(f"{page}: {key}" for page, key in named if key not in schema_keys)
    assert not unknown, f"config keys named in the docs that the schema does not have: {unknown}"


def test_every_shipped_config_is_in_the_configuration_page():
    page = (ROOT / "docs" / "configuration.md").read_text()
    missing = [p.name for p in sorted((ROOT / "recipes" / "configs").glob("*.yaml")) if f"recipes/configs/{p.name}" not in page]
    assert not missing, missing


def test_readme_keeps_the_ci_install_and_test_commands_and_is_short():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    install = next(line for line in ci.splitlines() if line.startswith("pip install torch"))
    assert f"```bash\n{install}\n```" in readme, "CI installs 'exactly as the README says': keep the line"
    assert "```bash\npython -m pytest tests\n```" in readme and "python -m pytest tests" in ci
    assert len(readme.splitlines()) <= 200


def test_site_builds_strictly(tmp_path):
    for module in ("mkdocs", "material", "mkdocstrings_handlers.python"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (pip install -e '.[test]' installs the docs tools)")
    p = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                        "-d", str(tmp_path / "site")], capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    assert (tmp_path / "site" / "fault_tolerance" / "index.html").is_file()
