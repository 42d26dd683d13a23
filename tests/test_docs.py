"""The README and docs/deploy.md stay true: every `ksana-jax` command in them parses with the
real CLI (and its engine flags make a valid EngineConfig), the pip extras they name exist,
the Prometheus config parses, and every metric they name is one the server exports."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

from ksana_jax.cli import build_parser, engine_config_from_args

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "docs" / "deploy.md"]


def code_blocks(path: Path, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", path.read_text(), re.S)


def commands(path: Path) -> list[list[str]]:
    """Shell words of each `ksana-jax ...` command (continuations joined, `&&` split)."""
    found = []
    text = "\n".join(code_blocks(path, "bash") + code_blocks(path, "ini"))
    text = text.replace("\\\n", " ")
    for line in text.splitlines():
        line = line.split("ExecStart=", 1)[-1]
        for part in line.split("&&"):
            words = shlex.split(part.split("#", 1)[0])
            if words and Path(words[0]).name == "ksana-jax":
                found.append(words[1:])
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_command_parses(doc):
    argvs = commands(doc)
    assert argvs, f"no ksana-jax commands found in {doc}"
    for argv in argvs:
        args = build_parser().parse_args(argv)
        if args.command == "serve":
            engine_config_from_args(args)  # raises on an invalid engine configuration


def test_named_extras_exist():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = set(pyproject["project"]["optional-dependencies"])
    named = {m for doc in DOCS for m in re.findall(r"'\.\[(\w+)\]'", doc.read_text())}
    assert named and named <= extras, named - extras


def test_prometheus_config_scrapes_metrics():
    (block,) = code_blocks(ROOT / "docs" / "deploy.md", "yaml")
    (job,) = yaml.safe_load(block)["scrape_configs"]
    assert job["metrics_path"] == "/metrics"


def test_named_metrics_are_exported():
    source = (ROOT / "server" / "metrics.py").read_text()
    exported = set(re.findall(r'"(ksana_\w+)"', source))
    for doc in DOCS:
        for name in set(re.findall(r"`(ksana_(?!jax)\w+)`", doc.read_text())):
            base = re.sub(r"_(total|bucket|count|sum)$", "", name)
            assert base in exported, f"{doc.name} names {name}, which /metrics does not export"


def test_serve_has_a_flag_per_engine_config_field():
    import dataclasses

    from ksana_jax import EngineConfig

    flags = "serve --max-num-seqs 8 --max-num-batched-tokens 64 --token-buckets 16,64"
    args = build_parser().parse_args([*flags.split(), "--dtype", "bfloat16"])
    config = engine_config_from_args(args)
    assert args.model == "demo"  # serve's MODEL defaults to the demo model
    assert config.max_num_seqs == 8 and config.token_buckets == (16, 64)
    assert config.dtype == "bfloat16"
    defaults = engine_config_from_args(build_parser().parse_args(["serve"]))
    assert defaults == EngineConfig()
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for field in dataclasses.fields(EngineConfig):
        assert f"--{field.name.replace('_', '-')}" in help_text
        assert field.metadata["help"].split(";")[0][:20] in " ".join(help_text.split())
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--dtype", "float16"])
