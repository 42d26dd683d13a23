"""A damaged checkpoint directory is named, not traced back: `ksana_jax.load` raises one
CheckpointError line naming the file (or parameter) and saying to convert again, and
`ksana-jax generate` / `serve` print that line and exit 2. The directory is recognised by its
own files, so a damaged one is never read as a Hugging Face directory instead."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import write_tiny_hf

import ksana_jax
from checkpoints_tools import convert
from ksana_jax import checkpoint, cli

REDO = "convert its source again: ksana-jax convert SOURCE"


def error_lines(stderr: str) -> list[str]:
    """stderr's lines but serve's progress line `ksana-jax: loading MODEL`, printed before."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    return [line for line in lines if not line.startswith("ksana-jax: loading ")]


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("damaged")
    write_tiny_hf(root / "hf")
    return convert(root / "hf", root / "ckpt")


def largest_data_file(ckpt: Path) -> Path:
    files = [p for p in (ckpt / "params").rglob("*") if p.is_file() and p.parent.name == "d"]
    return max(files, key=lambda p: p.stat().st_size)


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def edit_config(ckpt: Path, **changes) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(config | changes))


# name -> (damage, substrings the one-line message must hold, besides the directory)
CASES: dict[str, tuple[Callable[[Path], None], list[str]]] = {
    "truncated_params_data": (
        lambda d: truncate(largest_data_file(d)),
        ["parameter", "params", "damaged or truncated"],
    ),
    "missing_params_data": (
        lambda d: largest_data_file(d).unlink(),
        ["parameter", "params", "damaged or truncated"],
    ),
    "missing_params_dir": (lambda d: shutil.rmtree(d / "params"), ["params/ is missing"]),
    "garbage_params_metadata": (
        lambda d: (d / "params" / "_METADATA").write_text("garbage"),
        ["params/", "damaged"],
    ),
    "garbage_config_json": (
        lambda d: (d / "config.json").write_text("{not json"),
        ["config.json", "damaged"],
    ),
    "missing_config_json": (
        lambda d: (d / "config.json").unlink(),
        ["config.json is missing"],
    ),
    "config_json_wrong_shapes": (
        lambda d: edit_config(d, intermediate_size=128),
        ["config.json", "does not match", "layers.w_gate", "(3, 112, 96)", "(3, 128, 96)"],
    ),
    "config_json_more_layers": (
        lambda d: edit_config(d, num_hidden_layers=4),
        ["config.json", "does not match", "(3,", "(4,"],
    ),
    "config_json_unsupported_model_type": (
        lambda d: edit_config(d, model_type="gpt2"),
        ["config.json", "damaged", "gpt2"],
    ),
    "garbage_tokenizer_json": (
        lambda d: (d / "tokenizer.json").write_text("garbage"),
        ["tokenizer.json", "damaged"],
    ),
    "tokenizer_json_not_a_tokenizer": (
        lambda d: (d / "tokenizer.json").write_text('{"model": 3}'),
        ["tokenizer.json", "damaged"],
    ),
    "missing_tokenizer": (
        lambda d: (d / "tokenizer.json").unlink(),
        ["tokenizer.json", "is missing"],
    ),
    "garbage_tokenizer_config": (
        lambda d: (d / "tokenizer_config.json").write_bytes(b"\xff\xfe"),
        ["tokenizer_config.json", "damaged"],
    ),
    "garbage_generation_config": (
        lambda d: (d / "generation_config.json").write_text("[1, 2"),
        ["generation_config.json", "damaged"],
    ),
}


@pytest.fixture(params=list(CASES))
def damaged(request, good, tmp_path) -> tuple[Path, list[str]]:
    ckpt = Path(shutil.copytree(good, tmp_path / "ckpt"))
    damage, expected = CASES[request.param]
    damage(ckpt)
    return ckpt, expected


def test_load_names_the_damage(damaged):
    ckpt, expected = damaged
    assert checkpoint.is_checkpoint_dir(ckpt)  # never mistaken for an HF directory
    with pytest.raises(checkpoint.CheckpointError) as info:
        ksana_jax.load(ckpt)
    message = str(info.value)
    assert "\n" not in message
    for part in [str(ckpt), REDO, *expected]:
        assert part in message, f"{part!r} not in {message!r}"


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_cli_prints_one_line_and_exits_2(damaged, command, capsys):
    ckpt, _ = damaged
    argv = [command, str(ckpt)] + (["w5 w6", "--max-tokens", "2"] if command == "generate" else [])
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    lines = error_lines(captured.err)
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"ksana-jax {command}: error: ") and REDO in lines[0]
    assert "Traceback" not in captured.err


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_truncated_params_in_a_process_of_its_own(good, tmp_path, command):
    """The whole stderr of a real process: one line, no 'Event loop is closed' tracebacks
    from TensorStore's reads finishing after orbax's loop closed."""
    ckpt = Path(shutil.copytree(good, tmp_path / "ckpt"))
    largest_data_file(ckpt).unlink()
    argv = [command, str(ckpt)] + (["w5 w6"] if command == "generate" else ["--port", "0"])
    result = subprocess.run(
        [sys.executable, "-m", "ksana_jax.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert result.returncode == 2
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and "damaged or truncated" in lines[0], result.stderr
