"""`ksana-jax convert` given a broken source: each user error raises ConversionError with a
message naming the problem, which the CLI prints as one `ksana-jax convert: error:` line
(exit 2), leaving nothing behind; an unsupported dtype likewise. The rest of convert's
tests: test_convert.py."""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY_VOCAB

from checkpoints_tools import ConversionError, convert, read_source
from ksana_jax import cli
from tests.convert_helpers import (
    PREFIX,
    edit_json,
    edit_tensors,
    error_lines,
    read_json,
)


@dataclasses.dataclass
class Dirs:
    hf: Path  # editable copy of the 5.x single-file checkpoint
    tmp: Path
    sharded_template: Path

    def sharded(self) -> tuple[Path, list[str]]:
        """An editable copy of the sharded 4.x checkpoint and its shard file names."""
        path = Path(shutil.copytree(self.sharded_template, self.tmp / "sharded"))
        index = read_json(path / "model.safetensors.index.json")
        return path, sorted(set(index["weight_map"].values()))


# Each case breaks a checkpoint and returns (SOURCE to convert, substrings the message needs).
ERRORS: dict[str, Callable[[Dirs], tuple[Path, list[str]]]] = {}


def case(fn):
    ERRORS[fn.__name__] = fn
    return fn


@case
def no_config_json(d: Dirs):
    (d.hf / "config.json").unlink()
    return d.hf, [str(d.hf), "config.json"]


@case
def only_pytorch_model_bin(d: Dirs):
    (d.hf / "model.safetensors").unlink()
    (d.hf / "pytorch_model.bin").write_bytes(b"not really a pickle")
    return d.hf, [str(d.hf), "no weights", "model.safetensors", "pytorch_model.bin"]


@case
def shard_listed_in_index_is_missing(d: Dirs):
    path, shards = d.sharded()
    (path / shards[1]).unlink()
    return path, ["model.safetensors.index.json", shards[1], "do not exist"]


@case
def unknown_model_type(d: Dirs):
    def edit(c):
        c["model_type"], c["architectures"] = "gpt2", ["GPT2LMHeadModel"]

    edit_json(d.hf / "config.json", edit)
    expected = ["llama", "mistral", "qwen2", "LlamaForCausalLM", "Qwen2ForCausalLM"]
    return d.hf, [str(d.hf / "config.json"), "'gpt2'", *expected]


@case
def unknown_architecture(d: Dirs):
    edit_json(d.hf / "config.json", lambda c: c.update(architectures=["LlamaForTokenClass"]))
    supported = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"]
    return d.hf, [str(d.hf / "config.json"), "'LlamaForTokenClass'", *supported]


@case
def mistral_zero_sliding_window(d: Dirs):
    def edit(c):
        c.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=0)

    edit_json(d.hf / "config.json", edit)
    return d.hf, [str(d.hf / "config.json"), "positive sliding_window, got 0"]


@case
def qwen2_sliding_window_without_a_size(d: Dirs):
    def edit(c):
        c.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"], use_sliding_window=True)
        c.update(sliding_window=None, max_window_layers=1)

    edit_json(d.hf / "config.json", edit)
    return d.hf, [str(d.hf / "config.json"), "positive sliding_window, got None"]


@case
def rope_yarn_5x_layout(d: Dirs):
    def edit(c):
        c["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}

    edit_json(d.hf / "config.json", edit)
    return d.hf, [str(d.hf / "config.json"), "rope_type 'yarn'", "default", "linear", "llama3"]


@case
def rope_yarn_4x_layout(d: Dirs):
    def edit(c):
        del c["rope_parameters"]
        c["rope_theta"], c["rope_scaling"] = 1e4, {"type": "yarn", "factor": 4.0}

    edit_json(d.hf / "config.json", edit)
    return d.hf, [str(d.hf / "config.json"), "rope_type 'yarn'", "linear", "llama3"]


@case
def config_missing_required_field(d: Dirs):
    edit_json(d.hf / "config.json", lambda c: c.pop("hidden_size"))
    return d.hf, [str(d.hf / "config.json"), "'hidden_size'", "missing"]


@case
def corrupt_config_json(d: Dirs):
    (d.hf / "config.json").write_text('{"model_type": "llama",')
    return d.hf, ["cannot read", str(d.hf / "config.json")]


@case
def missing_tensor(d: Dirs):
    edit_tensors(d.hf, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    return d.hf, ["missing tensor", "model.layers.1.mlp.up_proj.weight"]


@case
def wrong_shape_layer_tensor(d: Dirs):
    name = "model.layers.2.self_attn.k_proj.weight"  # (K*H, D) = (32, 96), stored transposed
    edit_tensors(d.hf, lambda t: t.update({name: np.ascontiguousarray(t[name].T)}))
    return d.hf, [repr(name), "shape (96, 32)", "expected (32, 96)"]


@case
def wrong_shape_embedding(d: Dirs):
    name = "model.embed_tokens.weight"
    edit_tensors(d.hf, lambda t: t.update({name: t[name][:150]}))
    return d.hf, [repr(name), "shape (150, 96)", f"expected ({TINY_VOCAB}, 96)"]


@case
def unexpected_tensor(d: Dirs):
    name = "model.vision_tower.proj.weight"
    edit_tensors(d.hf, lambda t: t.update({name: np.zeros((4, 4), np.float32)}))
    return d.hf, ["unexpected tensor", repr(name)]


@case
def tensor_the_config_does_not_use(d: Dirs):
    name = "model.layers.0.self_attn.o_proj.bias"  # attention_bias is false
    edit_tensors(d.hf, lambda t: t.update({name: np.zeros(96, np.float32)}))
    return d.hf, ["unexpected tensor", repr(name), "does not use it"]


@case
def tensor_for_a_layer_beyond_num_hidden_layers(d: Dirs):
    name = "model.layers.3.mlp.up_proj.weight"
    edit_tensors(d.hf, lambda t: t.update({name: t["model.layers.0.mlp.up_proj.weight"]}))
    return d.hf, [repr(name), "layer 3", "3 layers"]


@case
def no_tokenizer_files(d: Dirs):
    (d.hf / "tokenizer.json").unlink()
    return d.hf, [str(d.hf), "no tokenizer", "tokenizer.json", "tokenizer.model"]


@case
def corrupt_tokenizer_json(d: Dirs):
    # Copying it unchecked would produce a checkpoint that cannot be loaded.
    (d.hf / "tokenizer.json").write_text('{"version": "1.0", "model":')
    return d.hf, [str(d.hf / "tokenizer.json")]


@case
def tokenizer_config_not_utf8(d: Dirs):
    (d.hf / "tokenizer_config.json").write_bytes(b"\xff\xfe{\x00}")
    return d.hf, ["cannot read", str(d.hf / "tokenizer_config.json")]


@case
def corrupt_safetensors(d: Dirs):
    (d.hf / "model.safetensors").write_bytes(b"this is not a safetensors file" * 10)
    return d.hf, ["cannot read", str(d.hf / "model.safetensors")]


@case
def truncated_safetensors(d: Dirs):
    file = d.hf / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    return d.hf, ["cannot read", str(file)]


@case
def corrupt_shard(d: Dirs):
    path, shards = d.sharded()
    (path / shards[2]).write_bytes(b"\0" * 64)
    return path, ["cannot read", str(path / shards[2])]


@case
def source_does_not_exist(d: Dirs):
    missing = d.tmp / "no" / "such-model"
    return missing, [str(missing), "does not exist"]


@case
def source_is_neither_directory_nor_gguf(d: Dirs):
    file = d.tmp / "model.bin"
    file.write_bytes(b"\0" * 16)
    return file, [str(file), "neither", ".gguf"]


@case
def corrupt_gguf(d: Dirs):
    file = d.tmp / "model.gguf"
    file.write_bytes(b"GGUX" + b"\0" * 60)
    return file, ["cannot read GGUF file", str(file)]


@pytest.mark.parametrize("name", list(ERRORS))
def test_user_error_names_the_problem(tmp_path, src, tiny_hf_4x, capsys, name):
    """The Python API raises ConversionError with a precise message; the CLI prints exactly that
    message as one `ksana-jax convert: error:` line and exits 2; nothing is left behind."""
    source, expected = ERRORS[name](Dirs(src, tmp_path, tiny_hf_4x[0]))
    parent = tmp_path / "models"
    parent.mkdir()
    (parent / "other-model").mkdir()
    out = parent / "ckpt"

    with pytest.raises(ConversionError) as info:
        convert(source, out)
    message = str(info.value)
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"
    assert "\n" not in message

    capsys.readouterr()
    assert cli.main(["convert", str(source), str(out)]) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert captured.out == ""
    lines = [line for line in error_lines(captured.err) if line.startswith("ksana-jax")]
    assert lines == [f"{PREFIX} {message}"]

    assert not out.exists()
    assert sorted(os.listdir(parent)) == ["other-model"]  # no staging directory left behind


def test_unsupported_dtype(src, tmp_path, capsys):
    out = tmp_path / "ckpt"
    with pytest.raises(ConversionError) as info:
        convert(src, out, dtype="float16")
    message = str(info.value)
    assert "'float16'" in message and "float32" in message and "bfloat16" in message
    assert not out.exists()
    with pytest.raises(ConversionError, match="'int8'"):
        read_source(src, dtype="int8")

    # On the command line argparse rejects it (and a missing argument) the same way.
    for argv in (["--dtype", "float16"], []):
        args = ["convert", str(src), *([str(out)] if argv else []), *argv]
        with pytest.raises(SystemExit) as exit_info:
            cli.main(args)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        last = error_lines(err)[-1]
        assert last.startswith(PREFIX)
        assert ("float16" in last) if argv else ("OUTPUT_DIR" in last)
    assert not out.exists()
