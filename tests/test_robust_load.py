"""Hostile and careless checkpoints (issue #26, load-time classes): each is a SluiceError at load, never a hang,
a crash, a giant allocation or another exception type."""

import json
import struct

import gguf
import pytest
from helpers import save_hf_dir, save_llama_gguf, tiny_llama

import sluice
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


def _same_size_pair(header):
    """Two tensors with the same byte count, in offset order."""
    by_size = {}
    for name, info in sorted(((k, v) for k, v in header.items() if k != "__metadata__"),
                             key=lambda kv: kv[1]["data_offsets"]):
        begin, end = info["data_offsets"]
        if end - begin in by_size:
            return by_size[end - begin], name
        by_size[end - begin] = name
    raise AssertionError("no two tensors of one size")


def _overlap(header):
    first, second = _same_size_pair(header)
    header[second]["data_offsets"] = list(header[first]["data_offsets"])


def _shift_last(header):
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])
    header[last]["data_offsets"] = [o - 2 for o in header[last]["data_offsets"]]


@pytest.mark.parametrize("damage, needle", [("tail", "not fully covered"), (_overlap, "invalid offset"),
                                            (_shift_last, "invalid offset")])
def test_safetensors_data_not_tiled_by_the_offsets(tmp_path, hf_dir, damage, needle):
    """Bytes no tensor covers, overlapping or shifted offsets: refused as `safetensors.safe_open` refuses them."""
    from safetensors import SafetensorError, safe_open

    d = _copy_dir(hf_dir, tmp_path / "m")
    f = d / "model.safetensors"
    if damage == "tail":
        f.write_bytes(f.read_bytes() + bytes(16))
    else:
        _rewrite_header(f, damage)
    with pytest.raises(SafetensorError):
        safe_open(str(f), "pt")
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


# -- class 3 (and the epsilon of class 6): config values checked in one place before any allocation ---------------

def _with_config(tmp_path, src_dir, **edits):
    d = _copy_dir(src_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(edits)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("edits, needle", [
    ({"num_key_value_heads": 2**31}, "num_key_value_heads"),
    ({"head_dim": 2**31}, "head_dim"),
    ({"num_key_value_heads": 3}, "divisor"),
    ({"hidden_size": "64"}, "hidden_size"),
    ({"hidden_size": 66, "head_dim": None}, "multiple of"),
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"vocab_size": 1.5}, "vocab_size"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps"),
    ({"rms_norm_eps": -1e-5}, "rms_norm_eps"),
    ({"rope_theta": float("inf")}, "rope_theta"),
    ({"num_hidden_layers": 2**40}, "num_hidden_layers"),
])
def test_llama_config_values(tmp_path, hf_dir, edits, needle):
    with pytest.raises(ModelFileError, match=needle) as e:
        sluice.load(_with_config(tmp_path, hf_dir, **edits), device="cpu")
    assert "config.json" in str(e.value)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    from test_qwen3_next import qwen3_next, save

    return save(qwen3_next(seed=1), tmp_path_factory.mktemp("q") / "hf")


@pytest.mark.parametrize("edits, needle", [
    ({"partial_rotary_factor": 2**32}, "partial_rotary_factor"),
    ({"partial_rotary_factor": float("nan")}, "malformed"),
    ({"num_hidden_layers": 2**40}, "num_hidden_layers"),
    ({"num_experts_per_tok": 99}, "num_experts_per_tok"),
    ({"linear_num_key_heads": 3}, "linear_num_value_heads"),
    ({"layer_types": [["x"], 2]}, "layer_types|malformed"),
])
def test_qwen3_next_config_values(tmp_path, qwen_dir, edits, needle):
    with pytest.raises(ModelFileError, match=needle):
        sluice.load(_with_config(tmp_path, qwen_dir, **edits), device="cpu")


def test_gguf_nan_or_negative_epsilon(tmp_path, gguf_bytes):
    pos = _value_type_pos(gguf_bytes, "llama.attention.layer_norm_rms_epsilon") + 4
    for value in (float("nan"), -1e-5):
        with pytest.raises(ModelFileError, match="rms_norm_eps"):
            _load(tmp_path, _patch(gguf_bytes, pos, "<f", value))


# -- class 5 and class 1: tensors that disagree with the config never reach a kernel ----------------------------

def _tensor_dims_pos(path, name: str) -> int:
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == name)
    return t.field.offset + sum(p.nbytes for p in t.field.parts[:3])  # after the name's length, name, n_dims


@pytest.mark.parametrize("dim0", [0, 32])
def test_short_norm_weight_refused(tmp_path, gguf_bytes, dim0):
    """A norm weight shorter than hidden_size (dim 0 set to 0 segfaulted the native RMSNorm)."""
    src = tmp_path / "ok.gguf"
    src.write_bytes(gguf_bytes)
    bad = _patch(gguf_bytes, _tensor_dims_pos(src, "blk.1.ffn_norm.weight"), "<Q", dim0)
    with pytest.raises(ModelFileError, match=r"blk.1|post_attention_layernorm.*config implies \(64,\)"):
        _load(tmp_path, bad)


def test_hf_config_disagreeing_with_tensors(tmp_path, hf_dir):
    for edits, needle in (({"intermediate_size": 128}, "mlp.gate_proj"), ({"vocab_size": 512}, "embed_tokens"),
                          ({"num_key_value_heads": 4}, "k_proj")):
        import shutil

        shutil.rmtree(tmp_path / "m", ignore_errors=True)
        with pytest.raises(ModelFileError, match=needle):
            sluice.load(_with_config(tmp_path, hf_dir, **edits), device="cpu")


def test_safetensors_metadata_of_any_type(tmp_path, hf_dir):
    """A non-string "format" in __metadata__ (found by the fuzzer: unhashable) is ignored like a missing one."""
    d = _copy_dir(hf_dir, tmp_path / "m")
    _rewrite_header(d / "model.safetensors", lambda h: h["__metadata__"].__setitem__("format", ["p"]))
    sluice.load(d, device="cpu")


def test_tokenizer_larger_than_embedding(tmp_path):
    """Token ids past the embedding's rows would be read out of bounds: refused at load."""
    d = save_hf_dir(tiny_llama(seed=1, vocab_size=200), tmp_path / "m")  # the tokenizer has 260 tokens
    with pytest.raises(ModelFileError, match="tokenizer has 260 tokens.*200 rows"):
        sluice.load(d, device="cpu")


def test_gguf_string_not_utf8(tmp_path, gguf_bytes):
    k = b"general.architecture"
    pos = gguf_bytes.index(struct.pack("<Q", len(k)) + k) + 8 + len(k) + 4 + 8  # the value's first byte
    with pytest.raises(ModelFileError, match="general.architecture.*UnicodeDecodeError"):
        _load(tmp_path, _patch(gguf_bytes, pos, "<B", 0x80))


def test_mlx_experts_half_quantized(tmp_path, qwen_dir):
    """The fuzzer's find: an MLX checkpoint whose expert gate lost its scales (dense) while up stays quantized."""
    from sluice.formats.convert import convert

    d = convert(qwen_dir, tmp_path / "mlx", bits=4, group_size=32, quiet=True)
    name = "model.layers.0.mlp.switch_mlp.gate_proj.scales"
    _rewrite_header(d / "model.safetensors", lambda h: h.__setitem__(name.replace("scales", "scalez"), h.pop(name)))
    with pytest.raises(ModelFileError, match="quantized differently"):
        sluice.load(d, device="cpu")


def test_every_load_error_names_the_file(tmp_path, gguf_bytes):
    """An error raised deep in a parser (here the GGUF tokenizer, which sees only metadata) still names the file."""
    key = b"tokenizer.ggml.model"
    bad = gguf_bytes.replace(struct.pack("<Q", len(key)) + key, struct.pack("<Q", len(key)) + b"tokenizer.ggml.mode_")
    with pytest.raises(ModelFileError, match=r"^.*bad\.gguf: GGUF has no tokenizer"):
        _load(tmp_path, bad)
