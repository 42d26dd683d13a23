"""`ksana-jax convert`: atomic output, the directory layout, and the command line (in-process
through `ksana_jax.cli.main`, and a few real subprocesses). User errors and their messages:
test_convert_errors.py."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY_VOCAB, hf_logits

import ksana_jax
from checkpoints_tools import ConversionError, convert, read_source
from ksana_jax import checkpoint, cli
from ksana_jax.config import ModelConfig
from ksana_jax.models import registry
from tests.convert_helpers import (
    PREFIX,
    all_tensors,
    edit_json,
    edit_tensors,
    error_lines,
    read_json,
    snapshot,
)

REPO = Path(__file__).resolve().parents[1]
# The template conftest.write_tiny_hf gives every tiny checkpoint.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
CHECKPOINT_FILES = [
    "config.json",
    "generation_config.json",
    "params",
    "params_layout.json",
    "tokenizer.json",
    "tokenizer_config.json",
]


# ----------------------------------------------------------------------------- OUTPUT_DIR


def test_existing_output_dir_is_refused_and_left_untouched(src, tmp_path, capsys):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    before = snapshot(out)

    with pytest.raises(ConversionError) as info:
        convert(src, out)
    assert str(out) in str(info.value) and "already exists" in str(info.value)
    assert "--force" in str(info.value)
    # Checked before the slow part: a bad SOURCE is not even looked at.
    with pytest.raises(ConversionError, match="already exists"):
        convert(tmp_path / "no-such-source", out)

    assert cli.main(["convert", str(src), str(out)]) == 2
    assert error_lines(capsys.readouterr().err)[-1] == f"{PREFIX} {info.value}"
    assert snapshot(out) == before
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "hf"]


def test_force_overwrites_an_existing_output_dir(src, tmp_path, capsys):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    assert convert(src, out, force=True) == out
    assert sorted(os.listdir(out)) == CHECKPOINT_FILES
    # Over an existing checkpoint, through the CLI.
    capsys.readouterr()
    assert cli.main(["convert", str(src), str(out), "--force"]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {out} in ")
    assert sorted(os.listdir(out)) == CHECKPOINT_FILES
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "hf"]
    assert ksana_jax.load(out).config == ModelConfig.from_hf_dict(read_json(src / "config.json"))


@pytest.mark.parametrize("force", [False, True], ids=["parent_is_a_file", "force_over_a_file"])
def test_output_path_blocked_by_a_regular_file_is_a_user_error(src, tmp_path, capsys, force):
    """OUTPUT_DIR below a regular file, or --force over a regular file: a one-line error (or,
    for --force, a replaced file), never a traceback."""
    blocker = tmp_path / "blocker"
    blocker.write_text("keep")
    out = blocker / "ckpt" if not force else blocker
    rc = cli.main(["convert", str(src), str(out), *(["--force"] if force else [])])
    captured = capsys.readouterr()
    if force and rc == 0:
        assert checkpoint.is_checkpoint_dir(out)
        return
    assert rc == 2
    lines = [line for line in error_lines(captured.err) if line.startswith("ksana-jax")]
    assert len(lines) == 1 and lines[0].startswith(PREFIX)
    assert str(blocker) in lines[0]
    assert blocker.read_text() == "keep"
    assert sorted(os.listdir(tmp_path)) == ["blocker", "hf"]


# ----------------------------------------------------------------------------- atomicity


@pytest.mark.parametrize(
    "error", [OSError(28, "No space left on device"), KeyboardInterrupt()], ids=["oserror", "ctrlc"]
)
def test_failure_while_writing_leaves_no_output_and_no_staging(src, tmp_path, monkeypatch, error):
    parent = tmp_path / "models"
    out = parent / "ckpt"
    seen: dict[str, Path] = {}

    def failing_save_params(path, params, cfg):
        staging = Path(path).parent
        seen["staging"] = staging
        assert staging.parent == parent and staging != out
        assert not out.exists()  # nothing at OUTPUT_DIR while writing
        # The partial directory already has config.json and the tokenizer but no params/,
        # so it is not a checkpoint and cannot be loaded as one (or as an HF directory).
        assert (staging / "config.json").is_file()
        assert not checkpoint.is_checkpoint_dir(staging)
        with pytest.raises(ValueError, match="no weights"):
            ksana_jax.load(staging)
        Path(path).mkdir()
        (Path(path) / "half-written").write_bytes(b"\0" * 128)
        raise error

    monkeypatch.setattr(checkpoint, "save_params", failing_save_params)
    with pytest.raises(type(error)):
        convert(src, out)
    assert not out.exists()
    assert not seen["staging"].exists()
    assert os.listdir(parent) == []


def test_failed_forced_overwrite_keeps_the_previous_checkpoint(src, tmp_path, monkeypatch):
    out = convert(src, tmp_path / "ckpt")
    before = snapshot(out)

    def failing_save_params(path, params, cfg):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "save_params", failing_save_params)
    with pytest.raises(OSError):
        convert(src, out, force=True)
    assert snapshot(out) == before
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "hf"]


def test_failure_midway_through_the_tensors_writes_nothing(src, tmp_path):
    """A bad tensor after many good ones: OUTPUT_DIR never appears, its parent is unchanged."""
    last = "model.layers.2.mlp.down_proj.weight"
    edit_tensors(src, lambda t: t.update({last: t[last][:, :-1]}))
    parent = tmp_path / "models"
    parent.mkdir()
    with pytest.raises(ConversionError, match=last):
        convert(src, parent / "ckpt")
    assert os.listdir(parent) == []


def test_only_a_complete_directory_loads(src, tmp_path):
    out = convert(src, tmp_path / "ckpt")
    assert checkpoint.is_checkpoint_dir(out)
    no_params = Path(shutil.copytree(out, tmp_path / "no-params"))
    shutil.rmtree(no_params / "params")
    no_config = Path(shutil.copytree(out, tmp_path / "no-config"))
    (no_config / "config.json").unlink()
    # Recognised by its own files (never read as an HF directory), and named as damaged.
    for partial, missing in ((no_params, "params/ is missing"), (no_config, "config.json is")):
        assert checkpoint.is_checkpoint_dir(partial)
        with pytest.raises(checkpoint.CheckpointError, match=str(partial)) as info:
            ksana_jax.load(partial)
        assert missing in str(info.value) and "--force" in str(info.value)


def test_a_checkpoint_of_the_old_matrix_layout_is_refused_by_name(src, tmp_path):
    """Checkpoints from before [out, in] matrices have no params_layout.json; their square
    matrices would restore silently transposed, so load refuses them and says what to do."""
    old = convert(src, tmp_path / "ckpt")
    (old / checkpoint.LAYOUT_FILE).unlink()
    assert checkpoint.is_checkpoint_dir(old) and not checkpoint.has_current_layout(old)
    with pytest.raises(ValueError, match=r"older ksana-jax.*ksana-jax convert SOURCE"):
        ksana_jax.load(old)


# ----------------------------------------------------------------------------- layout


@pytest.mark.parametrize("layout", ["5.x", "4.x"])
def test_converted_directory_layout(tmp_path, tiny_hf, tiny_hf_4x, layout):
    source = (tiny_hf if layout == "5.x" else tiny_hf_4x)[0]
    source_tokenizer_config = read_json(source / "tokenizer_config.json")
    if layout == "5.x":  # the template lives in its own file ...
        assert (source / "chat_template.jinja").read_text() == CHAT_TEMPLATE
        assert "chat_template" not in source_tokenizer_config
    else:  # ... or inside tokenizer_config.json, and the weights are sharded
        assert not (source / "chat_template.jinja").exists()
        assert source_tokenizer_config["chat_template"] == CHAT_TEMPLATE
        assert (source / "model.safetensors.index.json").is_file()

    out = convert(source, tmp_path / "ckpt")
    assert out == tmp_path / "ckpt"
    assert sorted(os.listdir(out)) == CHECKPOINT_FILES
    assert os.listdir(tmp_path) == ["ckpt"]

    # config.json: reads back to the same ModelConfig as the source's config.json.
    source_config = ModelConfig.from_hf_dict(read_json(source / "config.json"))
    assert ModelConfig.from_hf_dict(read_json(out / "config.json")) == source_config
    assert checkpoint.read_config(out) == source_config

    # Tokenizer: tokenizer.json copied, chat template folded into tokenizer_config.json.
    assert (out / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    tokenizer_config = read_json(out / "tokenizer_config.json")
    assert tokenizer_config["chat_template"] == CHAT_TEMPLATE
    for key in ("bos_token", "eos_token", "unk_token"):
        assert tokenizer_config[key] == source_tokenizer_config[key]
    assert read_json(out / "generation_config.json") == read_json(source / "generation_config.json")

    # params/: an orbax checkpoint holding exactly the model's arrays, matrices (out, in) as
    # in the source, and the layout marker that says so.
    assert checkpoint.has_current_layout(out)
    params = checkpoint.load_params(out, source_config, "float32")
    flat = {k: np.asarray(v) for k, v in registry.params_to_flat(params, source_config).items()}
    assert {k: v.shape for k, v in flat.items()} == registry.param_shapes(source_config)
    hf = all_tensors(source)
    np.testing.assert_array_equal(flat["embed"], hf["model.embed_tokens.weight"])
    np.testing.assert_array_equal(flat["final_norm"], hf["model.norm.weight"])
    np.testing.assert_array_equal(flat["lm_head"], hf["lm_head.weight"])
    for i in range(source_config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        np.testing.assert_array_equal(flat["layers.wq"][i], hf[prefix + "self_attn.q_proj.weight"])
        np.testing.assert_array_equal(flat["layers.w_down"][i], hf[prefix + "mlp.down_proj.weight"])
        np.testing.assert_array_equal(
            flat["layers.mlp_norm"][i], hf[prefix + "post_attention_layernorm.weight"]
        )

    model = ksana_jax.load(out)
    assert model.dtype == "float32" and model.config == source_config
    assert model.tokenizer.chat_template == CHAT_TEMPLATE
    assert model.tokenizer.apply_chat_template([{"role": "user", "content": "w5 w6"}]) == "w5 w6 "
    assert model.tokenizer.encode("w5 w6") == [5, 6]
    assert 2 in model.eos_token_ids


def test_named_chat_template_list_is_folded_to_the_default(src):
    (src / "chat_template.jinja").unlink()
    templates = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    edit_json(src / "tokenizer_config.json", lambda c: c.update(chat_template=templates))
    source = read_source(src)
    assert json.loads(source.tokenizer_files["tokenizer_config.json"])["chat_template"] == "D"


def test_harmless_extras_are_accepted(src):
    """rotary_emb.inv_freq buffers and a stored lm_head of a tied model are not errors."""

    def edit(t):
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)

    edit_tensors(src, edit)
    edit_json(src / "config.json", lambda c: c.update(tie_word_embeddings=True))
    source = read_source(src)
    assert source.config.tie_word_embeddings and "lm_head" not in source.params


# ----------------------------------------------------------------------------- CLI processes


def run_cli(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_convert_float32_logits_match_transformers(tmp_path, tiny_hf):
    source, hf_model = tiny_hf
    out = tmp_path / "ckpt"
    result = run_cli("checkpoints_tools", source, out, "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout.startswith(f"wrote {out} in ")
    assert len(result.stdout.splitlines()) == 1
    assert sorted(os.listdir(out)) == CHECKPOINT_FILES
    assert read_json(out / "config.json")["torch_dtype"] == "float32"

    model = ksana_jax.load(out)
    assert model.dtype == "float32"
    tokens = [int(t) for t in np.random.default_rng(7).integers(3, TINY_VOCAB, 21)]
    got = model.logits(tokens)
    assert got.shape == (len(tokens), TINY_VOCAB)
    np.testing.assert_allclose(got, hf_logits(hf_model, tokens), atol=1e-4, rtol=0)


@pytest.mark.parametrize("entry", ["checkpoints_tools", "ksana_jax.cli"])
@pytest.mark.parametrize("problem", ["missing_source", "wrong_shape"])
def test_cli_user_error_is_one_stderr_line(tmp_path, src, entry, problem):
    if problem == "missing_source":
        source, expected = tmp_path / "nowhere", "does not exist"
    else:
        name = "model.layers.1.self_attn.q_proj.weight"
        edit_tensors(src, lambda t: t.update({name: t[name][:-1]}))
        source, expected = src, f"tensor {name!r} has shape (95, 96), expected (96, 96)"
    command = [entry] if entry == "checkpoints_tools" else [entry, "convert"]
    result = run_cli(*command, source, tmp_path / "ckpt")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stdout == ""
    lines = error_lines(result.stderr)
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(PREFIX) and expected in lines[0]
    assert not (tmp_path / "ckpt").exists()


HELP_MENTIONS = {
    "convert": ["SOURCE", "OUTPUT_DIR", "--dtype", "float32", "bfloat16", "--force"],
    "generate": [
        "MODEL",
        "PROMPT",
        "--max-tokens",
        "--temperature",
        "--seed",
        "--chat",
        "--json",
        "--dtype",
        "auto",
    ],
}


@pytest.mark.parametrize("command", sorted(HELP_MENTIONS))
def test_cli_help_mentions_every_flag(command):
    result = run_cli("ksana_jax.cli", command, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    text = result.stdout
    assert text.startswith(f"usage: ksana-jax {command}")
    for word in HELP_MENTIONS[command]:
        assert word in text
    # Every argument the parser defines, so a new flag cannot be left out of this test.
    subparsers = next(
        a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    )
    for action in subparsers.choices[command]._actions:
        for name in action.option_strings or [action.metavar]:
            assert name in text
