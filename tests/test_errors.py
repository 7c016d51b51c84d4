"""Bad input a user can give: each is a SluiceError saying what is wrong, and exit status 2 from the CLI."""

import shutil
import subprocess
import sys

import gguf
import numpy as np
import pytest

import sluice
from helpers import save_hf_dir, save_llama_gguf, tiny_llama
from sluice.cli import main
from sluice.errors import (ContextLengthError, InvalidOptionError, ModelFileError, SluiceError,
                           UnsupportedError)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return save_llama_gguf(tiny_llama(seed=3), tmp_path_factory.mktemp("g") / "tiny.gguf")


def cli_fails(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "sluice: error:" in err and needle in err, err
    assert "Traceback" not in err


def test_truncated_gguf(tmp_path, tiny_gguf, capsys):
    data = tiny_gguf.read_bytes()
    for cut in (10, len(data) // 3, len(data) - 100):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ModelFileError, match="truncated|corrupt"):
            sluice.load(bad, device="cpu")
    cli_fails(capsys, ["run", "hi", "--model", str(bad)], "truncated")


def test_corrupted_gguf_header(tmp_path, tiny_gguf):
    data = bytearray(tiny_gguf.read_bytes())
    data[8:40] = b"\xff" * 32  # tensor/kv counts become absurd
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelFileError, match="truncated or corrupt|truncated"):
        sluice.load(bad, device="cpu")


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_text("hello")
    with pytest.raises(ModelFileError, match="not a GGUF"):
        sluice.load(bad, device="cpu")


def test_missing_path(tmp_path, capsys):
    with pytest.raises(ModelFileError, match="no such file"):
        sluice.load(tmp_path / "nope.gguf", device="cpu")
    cli_fails(capsys, ["run", "hi", "--model", str(tmp_path / "nope")], "no such file")


def test_directory_without_config(tmp_path, capsys):
    d = save_hf_dir(tiny_llama(), tmp_path / "m")
    (d / "config.json").unlink()
    with pytest.raises(ModelFileError, match="config.json"):
        sluice.load(d, device="cpu")
    cli_fails(capsys, ["info", str(d)], "config.json")


def test_truncated_safetensors(tmp_path):
    d = save_hf_dir(tiny_llama(), tmp_path / "m")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-64])
    with pytest.raises(ModelFileError, match="truncated"):
        sluice.load(d, device="cpu")


def test_unsupported_architecture_hf(tmp_path, capsys):
    import json

    d = save_hf_dir(tiny_llama(), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "mamba"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedError, match="mamba"):
        sluice.load(d, device="cpu")
    cli_fails(capsys, ["run", "x", "--model", str(d)], "unsupported model architecture 'mamba'")


def _write(w):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unsupported_architecture_gguf(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "rwkv6")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    _write(w)
    with pytest.raises(UnsupportedError, match="rwkv6"):
        sluice.load(tmp_path / "m.gguf", device="cpu")


def test_unsupported_tensor_type(tmp_path, capsys):
    """A K-quant tensor is named with its type, and the message says what is supported."""
    src = gguf.GGUFReader(save_llama_gguf(tiny_llama(seed=3), tmp_path / "ok.gguf"))
    w = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    for f in src.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        w.add_key_value(f.name, f.contents(), f.types[0], sub_type=f.types[-1] if len(f.types) > 1 else None)
    for t in src.tensors:
        if t.name == "blk.0.attn_q.weight":  # one Q4_K block (256 values, 144 bytes) per row
            w.add_tensor(t.name, np.zeros((64, 144), dtype=np.uint8),
                         raw_dtype=gguf.GGMLQuantizationType.Q4_K)
        else:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    _write(w)
    with pytest.raises(UnsupportedError, match="Q4_K"):
        sluice.load(tmp_path / "k.gguf", device="cpu")
    cli_fails(capsys, ["run", "x", "--model", str(tmp_path / "k.gguf")], "Q4_K")


def test_prompt_longer_than_context(tiny_gguf, capsys):
    model = sluice.load(tiny_gguf, device="cpu")
    too_long = [5] * (model.context_length + 1)
    with pytest.raises(ContextLengthError, match="context window"):
        model.generate(too_long, max_tokens=1)
    with pytest.raises(ContextLengthError):
        model.logits(too_long)
    cli_fails(capsys, ["run", "a " * (model.context_length + 10), "--model", str(tiny_gguf)], "context window")


@pytest.mark.parametrize("argv,needle", [
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--top-p", "1.5"], "top_p"),
    (["--top-k", "-3"], "top_k"),
    (["--min-p", "1.2"], "min_p"),
    (["--repetition-penalty", "0"], "repetition_penalty"),
    (["--max-tokens", "-5"], "max_tokens"),
    (["--device", "tpu"], "device"),
    (["--dtype", "int3"], "dtype"),
])
def test_bad_options(tiny_gguf, capsys, argv, needle):
    cli_fails(capsys, ["run", "hi", "--model", str(tiny_gguf), *argv], needle)


def test_bad_options_api(tiny_gguf):
    model = sluice.load(tiny_gguf, device="cpu")
    with pytest.raises(InvalidOptionError, match="temperature"):
        model.generate("hi", temperature=-1)
    with pytest.raises(InvalidOptionError, match="load option"):
        sluice.load(tiny_gguf, device="cpu", kv_cahce="dense")
    with pytest.raises(InvalidOptionError, match="token ids"):
        model.logits([10_000])


def test_all_user_errors_are_sluice_errors():
    for cls in (ContextLengthError, InvalidOptionError, ModelFileError, UnsupportedError):
        assert issubclass(cls, SluiceError)


@pytest.mark.skipif(shutil.which("sluice") is None, reason="console script not installed")
def test_console_script_exit_status(tmp_path):
    proc = subprocess.run(["sluice", "run", "hi", "--model", str(tmp_path / "missing.gguf")], capture_output=True,
                          text=True)
    assert proc.returncode == 2
    assert "no such file" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "sluice", "run", "--temperature", "-1", "x"], capture_output=True,
                          text=True)
    assert proc.returncode == 2 and "temperature" in proc.stderr
