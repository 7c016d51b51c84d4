"""Hostile and careless checkpoints (issue #26, load-time classes): each is a SluiceError at load, never a hang,
a crash, a giant allocation or another exception type."""

import json
import math
import struct

import gguf
import pytest

import sluice
from helpers import save_hf_dir, save_llama_gguf, tiny_llama
from sluice.errors import ModelFileError, SluiceError


@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory):
    return save_llama_gguf(tiny_llama(seed=5), tmp_path_factory.mktemp("g") / "tiny.gguf").read_bytes()


def _patch(data: bytes, pos: int, fmt: str, value) -> bytes:
    b = bytearray(data)
    struct.pack_into(fmt, b, pos, value)
    return bytes(b)


def _value_type_pos(data: bytes, key: str) -> int:
    """The offset of the uint32 value type that follows metadata key `key`."""
    k = key.encode()
    return data.index(struct.pack("<Q", len(k)) + k) + 8 + len(k)


def _tensor_offset_pos(path, name: str) -> int:
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == name)
    return t.field.offset + sum(p.nbytes for p in t.field.parts[:-1])


def _load(tmp_path, data: bytes, name="bad.gguf"):
    p = tmp_path / name
    p.write_bytes(data)
    return sluice.load(p, device="cpu")


# -- class 2: counts that run past the end of the file are refused before anything loops over them ------------

@pytest.mark.parametrize("key", ["general.architecture", "tokenizer.ggml.model"])
def test_string_turned_array_does_not_hang(tmp_path, gguf_bytes, key):
    bad = _patch(gguf_bytes, _value_type_pos(gguf_bytes, key), "<I", 9)  # STRING -> ARRAY
    with pytest.raises(ModelFileError, match="corrupt"):
        _load(tmp_path, bad)


def test_huge_array_count_does_not_hang(tmp_path, gguf_bytes):
    pos = _value_type_pos(gguf_bytes, "tokenizer.ggml.token_type") + 8  # after the type and the item type
    bad = _patch(gguf_bytes, pos, "<Q", 2**63 - 1)
    with pytest.raises(ModelFileError, match="claims .* items"):
        _load(tmp_path, bad)


# -- class 6: tensor offsets that wrap, overlap or are misaligned ------------------------------------------------

@pytest.mark.parametrize("offset, needle", [(2**64 - 32, "past the end"), (4, "alignment"), (0, "overlap")])
def test_bad_tensor_offsets(tmp_path, gguf_bytes, offset, needle):
    src = tmp_path / "ok.gguf"
    src.write_bytes(gguf_bytes)
    bad = _patch(gguf_bytes, _tensor_offset_pos(src, "blk.1.ffn_norm.weight"), "<Q", offset)
    with pytest.raises(ModelFileError, match=needle):
        _load(tmp_path, bad)


# -- class 4: library and parser errors become ModelFileErrors naming the file -----------------------------------

@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return save_hf_dir(tiny_llama(seed=5), tmp_path_factory.mktemp("hf") / "m")


def _copy_dir(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def _rewrite_header(path, edit):
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    edit(header)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (n - len(raw)) if len(raw) <= n else b""
    assert len(raw) == n, "the edit must not lengthen the header"
    path.write_bytes(data[:8] + raw + data[8 + n:])


@pytest.mark.parametrize("edit, needle", [
    (lambda h: h.__setitem__("model.norm.weight", [1, 2]), "not a JSON object"),
    (lambda h: h["model.norm.weight"].__setitem__("shape", "64"), "shape"),
    (lambda h: h["model.norm.weight"].__setitem__("shape", [None]), "shape"),
    (lambda h: h["model.norm.weight"].__setitem__("data_offsets", [9, 1]), "data_offsets"),
    (lambda h: h["model.norm.weight"].__setitem__("data_offsets", [0]), "data_offsets"),
    (lambda h: h["model.norm.weight"].pop("dtype"), "dtype"),
    (lambda h: h.__setitem__("__metadata__", 7), "__metadata__"),
])
def test_malformed_safetensors_header(tmp_path, hf_dir, edit, needle):
    d = _copy_dir(hf_dir, tmp_path / "m")
    _rewrite_header(d / "model.safetensors", edit)
    with pytest.raises(ModelFileError, match=needle) as e:
        sluice.load(d, device="cpu")
    assert "model.safetensors" in str(e.value)


@pytest.mark.parametrize("raw, needle", [(b'{"model_type": "llama\xff\xfe"}', "UTF-8"), (b"[1, 2]", "JSON object")])
def test_bad_config_json(tmp_path, hf_dir, raw, needle):
    d = _copy_dir(hf_dir, tmp_path / "m")
    (d / "config.json").write_bytes(raw)
    with pytest.raises(ModelFileError, match=needle):
        sluice.load(d, device="cpu")


def test_tokenizer_rust_panic_is_a_model_file_error(tmp_path, hf_dir, monkeypatch):
    import tokenizers

    class PanicException(BaseException):  # what pyo3 raises when Rust code panics
        pass

    def panic(text):
        raise PanicException("called `Option::unwrap()` on a `None` value")

    monkeypatch.setattr(tokenizers.Tokenizer, "from_str", panic)
    with pytest.raises(ModelFileError, match="tokenizer.json.*PanicException"):
        sluice.load(hf_dir, device="cpu")


def test_wrongly_typed_tokenizer_metadata(tmp_path, gguf_bytes):
    """tokenizer.ggml.model's STRING turned into a UINT64 (same byte length as the string's length field)."""
    bad = _patch(gguf_bytes, _value_type_pos(gguf_bytes, "tokenizer.ggml.model"), "<I", 10)
    with pytest.raises(SluiceError):
        _load(tmp_path, bad)
