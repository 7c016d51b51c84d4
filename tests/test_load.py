"""Loading: dummy weights from a config.json (formats/dummy.py), the benchmark configs, tensors read straight to
the device or memory-mapped on the CPU (formats/hf.py), the loader's options, and the load_memory benchmark."""

import gc
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import byte_level_tokenizer_json

import sluice
from sluice.errors import InvalidOptionError, ModelFileError, UnsupportedError
from sluice.formats.dummy import DummyCheckpoint
from sluice.quant.affine import QuantizedTensor

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "benchmarks" / "configs"
REAL = ["qwen3-next-80b-a3b", "qwen3.5-35b-a3b", "qwen3.5-122b-a10b", "qwen3.5-397b-a17b"]


def shrunk(name: str, layers: int = 4) -> dict:
    """A benchmark config with every dimension cut down (the same structure: GDN + gated attention every 4th
    layer, MoE with a shared expert, 8-bit router gates)."""
    c = json.loads((CONFIGS / f"{name}.json").read_text())
    text = c.get("text_config", c)
    text.update(hidden_size=128, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                linear_value_head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                shared_expert_intermediate_size=64, vocab_size=1000)
    if "intermediate_size" in text:
        text["intermediate_size"] = 128
    if "layer_types" in text:
        text["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    prefix = "language_model.model." if c["model_type"] == "qwen3_5_moe" else "model."
    q = {k: v for k, v in c["quantization"].items() if ".layers." not in k}
    for i in range(layers):
        q[f"{prefix}layers.{i}.mlp.gate"] = q[f"{prefix}layers.{i}.mlp.shared_expert_gate"] = {"group_size": 64,
                                                                                                 "bits": 8}
    c["quantization"] = c["quantization_config"] = q
    return c


def tiny_llama_config(quantized: bool = True) -> dict:
    c = {"model_type": "llama", "vocab_size": 300, "hidden_size": 128, "intermediate_size": 256,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
         "max_position_embeddings": 256, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    if quantized:
        c["quantization"] = {"group_size": 64, "bits": 4}
    return c


def write_config(path: Path, config: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def logical_params(d: DummyCheckpoint) -> int:
    n = 0
    for name, s in d.specs.items():
        if name.endswith((".scales", ".biases")):
            continue
        module = name.removesuffix(".weight")
        n += math.prod(s.shape) * (32 // d.quantization(module)[0] if d.has(module + ".scales") else 1)
    return n


# -- the benchmark configs --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", REAL)
def test_benchmark_configs_parse_and_have_the_published_sizes(name):
    from sluice.models.qwen3_next import Qwen3NextConfig

    config = json.loads((CONFIGS / f"{name}.json").read_text())
    cfg = Qwen3NextConfig.from_hf(config)
    d = DummyCheckpoint(CONFIGS / f"{name}.json")  # no tensor is made
    params = logical_params(d)
    nominal = {"qwen3-next-80b-a3b": 80e9, "qwen3.5-35b-a3b": 35e9, "qwen3.5-122b-a10b": 122e9,
               "qwen3.5-397b-a17b": 397e9}[name]
    assert abs(params / nominal - 1) < 0.02  # the Qwen3.5 totals include a ~0.4B vision tower we do not build
    # 4-bit, group 64, bf16 scales and biases: 0.5625 bytes a parameter (the 8-bit gates and norms add ~0.1%)
    assert 0.5625 < d.total_bytes / params < 0.57
    p = "language_model.model." if cfg.model_type == "qwen3_5_moe" else "model."
    E, H = cfg.num_experts, cfg.hidden_size
    assert d.specs[p + "layers.0.mlp.gate.weight"].shape == (E, H // 4)  # 8-bit router
    assert d.specs[p + "layers.0.mlp.shared_expert_gate.weight"].shape == (1, H // 4)
    assert d.specs[p + "layers.0.mlp.switch_mlp.down_proj.weight"].shape == (E, H, cfg.moe_intermediate_size // 8)


def test_qwen3_next_80b_matches_the_published_parameter_count_and_mlx_size():
    d = DummyCheckpoint(CONFIGS / "qwen3-next-80b-a3b.json")
    assert logical_params(d) == 79_674_391_296  # HF's count for Qwen3-Next-80B-A3B (without the MTP layer)
    assert abs(d.total_bytes / 1e9 - 44.84) < 0.01  # mlx-community's 4-bit checkpoint: ~44.8 GB


# -- the dummy reader -------------------------------------------------------------------------------------------

class Recorder:
    """A reader wrapper that notes which tensors a builder asks for."""

    def __init__(self, src):
        self.src, self.asked = src, []

    def __getattr__(self, name):
        return getattr(self.src, name)

    def tensor(self, name):
        self.asked.append(name)
        return self.src.tensor(name)


@pytest.mark.parametrize("config", [shrunk("qwen3-next-80b-a3b"), shrunk("qwen3.5-35b-a3b"),
                                    tiny_llama_config(), tiny_llama_config(quantized=False)],
                         ids=["qwen3-next", "qwen3.5-nested", "llama-4bit", "llama-dense"])
def test_builders_take_exactly_the_dummy_tensors(config, tmp_path):
    """The builders check every shape against the config; every tensor the reader lists is asked for once."""
    from sluice.models import architecture_module

    d = DummyCheckpoint(write_config(tmp_path, config))
    rec = Recorder(d)
    architecture_module(config["model_type"]).build_from_hf(rec, torch.float32)
    assert len(rec.asked) == len(set(rec.asked))
    modules = [n.removesuffix(".weight") for n in rec.asked]
    quant_parts = {m + part for m in modules if d.has(m + ".scales") for part in (".scales", ".biases")}
    assert set(rec.asked) | quant_parts == set(d.names())


def _hf_tiny(kind: str, path: Path) -> Path:
    """A tiny HF checkpoint: Qwen3-Next, Qwen3.5-MoE text-only, or Qwen3.5-MoE in the published multimodal layout."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file

    kw = {"vocab_size": 300, "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
          "linear_key_head_dim": 32, "linear_value_head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
          "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64, "full_attention_interval": 2,
          "max_position_embeddings": 512}
    torch.manual_seed(0)
    if kind == "qwen3_next":
        model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(intermediate_size=128, **kw))
    else:
        model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**kw))
    flat = path / "flat"
    model.float().save_pretrained(flat, safe_serialization=True)
    byte_level_tokenizer_json(flat)
    if kind != "qwen3_5_moe":
        return flat
    nested = path / "nested"
    nested.mkdir()
    tensors = {("model.language_model." + k.removeprefix("model.")) if k.startswith("model.") else k: v
               for k, v in load_file(str(flat / "model.safetensors")).items()}
    save_file(tensors, str(nested / "model.safetensors"))
    text = json.loads((flat / "config.json").read_text())
    (nested / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe", "text_config": text}))
    byte_level_tokenizer_json(nested)
    return nested


@pytest.fixture(scope="module", params=[("qwen3_next", 64), ("qwen3_5_moe_text", 32), ("qwen3_5_moe", 32)],
                ids=["qwen3-next-g64", "qwen3.5-text-g32", "qwen3.5-nested-g32"])
def converted(request, tmp_path_factory):
    """An MLX checkpoint written by `sluice convert` (mlx-lm's names, shapes, dtypes and config keys)."""
    from sluice.formats.convert import convert

    kind, group = request.param
    tmp = tmp_path_factory.mktemp(kind)
    return convert(_hf_tiny(kind, tmp), tmp / "mlx", bits=4, group_size=group, quiet=True)


def test_dummy_checkpoint_is_the_converted_checkpoint_tensor_for_tensor(converted):
    """Names, shapes and dtypes of the dummy reader equal those of a real MLX checkpoint of the same config.json
    (so also the same tensors quantized, at the same bits: the 8-bit gates, the skipped 64-wide inputs)."""
    from sluice.formats.hf import HFDirectory

    real, dummy = HFDirectory(converted), DummyCheckpoint(converted)
    assert set(dummy.names()) == set(real.names())
    for name in real.names():
        e = real._entries[name]
        assert (dummy.specs[name].shape, dummy.specs[name].dtype) == (e.shape, e.dtype), name
    assert dummy.total_bytes == real.total_bytes


@pytest.mark.parametrize("name,layers", [("qwen3-next-80b-a3b", 48), ("qwen3.5-35b-a3b", 8)])
def test_dummy_models_run_with_finite_sane_logits(name, layers, tmp_path):
    """48 layers deep, the residual stream stays of order one: logits finite with a std near 1."""
    model = sluice.load(write_config(tmp_path, shrunk(name, layers)), load_format="dummy", device="cpu",
                        max_batch=1, max_seq_len=64)
    ids = torch.randint(0, 1000, (1, 24), generator=torch.Generator().manual_seed(0))
    logits = model.logits(ids)
    assert logits.shape == (1, 24, 1000) and torch.isfinite(logits).all()
    assert 0.3 < float(logits.std()) < 3.0
    assert len(list(model.generate_ids([1, 2, 3], max_tokens=4, temperature=0.0))) == 4  # no stop token


@pytest.mark.parametrize("quantized", [True, False])
def test_dummy_llama_runs(quantized, tmp_path):
    model = sluice.load(write_config(tmp_path, tiny_llama_config(quantized)), load_format="dummy", device="cpu",
                        dtype="bfloat16", max_batch=1, max_seq_len=64)
    logits = model.logits([[5, 6, 7, 8]])
    assert torch.isfinite(logits).all() and 0.3 < float(logits.std()) < 3.0
    assert model.format == "dummy"


def test_dummy_values_have_the_intended_statistics(tmp_path):
    d = DummyCheckpoint(write_config(tmp_path, shrunk("qwen3-next-80b-a3b")))
    expert = d.tensor("model.layers.0.mlp.switch_mlp.down_proj.weight")  # [8, 128, 64], 4-bit
    router = d.tensor("model.layers.0.mlp.gate.weight")  # [8, 128], 8-bit
    assert isinstance(expert, QuantizedTensor) and (expert.bits, expert.group_size) == (4, 64)
    assert (router.bits, router.group_size) == (8, 64)
    for qt in (expert, router):
        w = qt.dequantize()
        assert abs(float(w.mean())) < 0.1 / math.sqrt(w.shape[-1])
        assert abs(float(w.std()) * math.sqrt(w.shape[-1]) - 1) < 0.05  # std 1/sqrt(fan_in)
    a_log = d.tensor("model.layers.0.linear_attn.A_log").float()
    assert ((a_log >= 0) & (a_log <= math.log(16) + 1e-3)).all()
    assert (d.tensor("model.layers.0.input_layernorm.weight") == 1).all()
    conv = d.tensor("model.layers.0.linear_attn.conv1d.weight")
    assert conv.shape == (2 * 64 + 128, 4, 1) and 0.1 < float(conv.float().std()) < 0.5


def test_dummy_values_are_reproducible_and_per_tensor(tmp_path):
    path = write_config(tmp_path, shrunk("qwen3-next-80b-a3b"))
    a, b = DummyCheckpoint(path), DummyCheckpoint(path)
    name = "model.layers.1.linear_attn.out_proj.weight"
    assert torch.equal(a.tensor(name).weight, b.tensor(name).weight)
    assert not torch.equal(a.tensor(name).weight, a.tensor("model.layers.2.linear_attn.out_proj.weight").weight)
    assert not torch.equal(a.tensor(name).weight, DummyCheckpoint(path, seed=1).tensor(name).weight)


def test_dummy_tokenizer_stand_in_and_tokenizer_json(tmp_path):
    d = DummyCheckpoint(write_config(tmp_path / "bare", tiny_llama_config()))
    tok = d.tokenizer()
    vocab = tiny_llama_config()["vocab_size"]
    assert tok.vocab_size == vocab and not tok.stop_ids and tok.decode(tok.encode("héllo")) == "héllo"
    assert all(tok.decode([i]) for i in range(vocab) if i >= 256)  # every id of the model's vocabulary is text
    with_tok = write_config(tmp_path / "tok", tiny_llama_config())
    byte_level_tokenizer_json(with_tok)
    assert DummyCheckpoint(with_tok / "config.json").tokenizer().eos_id == 0


def test_load_format_errors(tmp_path):
    path = write_config(tmp_path / "m", tiny_llama_config())
    with pytest.raises(InvalidOptionError, match=r"load_format='safetensors'.*'auto', 'dummy'"):
        sluice.load(path, load_format="safetensors", device="cpu")
    with pytest.raises(InvalidOptionError, match="needs a path"):
        sluice.load(None, load_format="dummy", device="cpu")
    with pytest.raises(ModelFileError, match="no config.json"):
        sluice.load(tmp_path, load_format="dummy", device="cpu")
    with pytest.raises(UnsupportedError, match="gpt2"):
        DummyCheckpoint(write_config(tmp_path / "g", {"model_type": "gpt2"}))
    bad = dict(tiny_llama_config(), quantization={"group_size": 48, "bits": 4})
    with pytest.raises(UnsupportedError, match="group_size=48"):
        DummyCheckpoint(write_config(tmp_path / "b", bad))


# -- reading safetensors: memory-mapped on the CPU, staged reads for a device ------------------------------------

def _file_mappings() -> list[tuple[int, int, str]]:
    if not Path("/proc/self/maps").exists():
        pytest.skip("needs /proc/self/maps (Linux)")
    out = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 6 and parts[5].endswith(".safetensors"):
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out.append((lo, hi, parts[5]))
    return out


def test_cpu_tensors_are_views_of_the_mapped_file(converted):
    """On the CPU the packed words, scales and biases are the file's pages (copy-on-write mapping), not copies."""
    from sluice.formats.hf import HFDirectory

    d = HFDirectory(converted)
    qt = d.tensor("lm_head.weight" if d.has("lm_head.weight") else "language_model.lm_head.weight")
    maps = _file_mappings()
    for t in (qt.weight, qt.scales, qt.biases):
        assert any(lo <= t.data_ptr() and t.data_ptr() + t.nbytes <= hi and Path(f).parent == converted
                   for lo, hi, f in maps)
    del d
    gc.collect()
    assert torch.isfinite(qt.dequantize()).all()  # the tensors keep their mapping alive


def test_loaded_cpu_model_keeps_weights_mapped(converted):
    gc.collect()
    assert not any(Path(f).parent == converted for *_, f in _file_mappings())
    model = sluice.load(converted, device="cpu")
    gc.collect()  # the reader is gone; only the model's weights can hold the mapping
    assert any(Path(f).parent == converted for *_, f in _file_mappings())
    assert torch.isfinite(model.logits([[1, 2, 3]])).all()


def test_staged_reads_equal_the_mapped_tensors(converted, monkeypatch):
    """The read path used for GPUs (pread into two alternating staging buffers), run into CPU memory with buffers
    of 1000 bytes so that tensors span many chunks: byte for byte the file's tensors."""
    from sluice.formats import hf

    monkeypatch.setattr(hf, "CHUNK", 1000)
    d = hf.HFDirectory(converted)
    for name, e in d._entries.items():
        assert torch.equal(d._read(e, torch.device("cpu")), d._mapped(e)), name
    d.close()


def test_progress_bar_only_on_a_terminal(converted, capsys, monkeypatch):
    sluice.load(converted, device="cpu")
    assert "loading" not in capsys.readouterr().err
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    sluice.load(converted, device="cpu")
    assert "loading" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_load_reads_each_tensor_to_the_gpu(converted):
    from sluice.formats.hf import HFDirectory

    d = HFDirectory(converted)
    for name in d.names():
        on_gpu = d.tensor(name, "cuda")
        parts = (on_gpu.weight, on_gpu.scales, on_gpu.biases) if isinstance(on_gpu, QuantizedTensor) else (on_gpu,)
        assert all(t.is_cuda for t in parts)
        cpu = d.tensor(name)
        assert torch.equal(parts[0].cpu(), cpu.weight if isinstance(cpu, QuantizedTensor) else cpu)
    ids = [[3, 1, 4, 1, 5, 9, 2, 6]]
    gpu_logits = sluice.load(converted, device="cuda", dtype="float32").logits(ids)
    cpu_logits = sluice.load(converted, device="cpu").logits(ids)
    assert float((gpu_logits - cpu_logits).norm() / cpu_logits.norm()) < 1e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_dummy_weights_are_made_on_the_gpu(tmp_path):
    d = DummyCheckpoint(write_config(tmp_path, shrunk("qwen3.5-35b-a3b")))
    qt = d.tensor("language_model.model.layers.0.mlp.switch_mlp.gate_proj.weight", "cuda")
    assert qt.weight.is_cuda and qt.scales.is_cuda
    model = sluice.load(tmp_path, load_format="dummy", device="cuda")
    assert torch.isfinite(model.logits([[1, 2, 3, 4]])).all()


# -- the load_memory benchmark -------------------------------------------------------------------------------------

def test_load_memory_benchmark_at_a_tiny_size(tmp_path):
    """The benchmark end to end on the CPU (`python -m benchmarks run load_memory`): a valid sharded MLX checkpoint
    (readable by the safetensors library, tensor for tensor the dummy reader's layout), loaded in fresh processes,
    measured, written as the runner's JSON record."""
    from safetensors import safe_open

    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(shrunk("qwen3-next-80b-a3b", layers=8)))
    out, ckpt = tmp_path / "result.json", tmp_path / "ckpt"
    subprocess.run([sys.executable, "-m", "benchmarks", "run", "load_memory", "--json", str(out), "--config",
                    str(config), "--gb", "0.001", "--shard-gb", "0.0004", "--device", "cpu", "--dir", str(ckpt),
                    "--keep"], check=True, capture_output=True, timeout=300, cwd=ROOT)
    record = json.loads(out.read_text())
    assert record["benchmark"] == "load_memory" and record["gpu"] is None
    result = record["figures"]
    assert result["checkpoint"]["shards"] > 1 and [r["run"] for r in result["runs"]] == ["cold", "warm"]
    assert all(r["finite_logits"] and r["peak_rss"] > 0 for r in result["runs"])
    layout = {}
    for f in ckpt.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as st:
            assert st.metadata() == {"format": "mlx"}
            layout.update({n: st.get_slice(n).get_shape() for n in st.keys()})  # noqa: SIM118
    dummy = DummyCheckpoint(ckpt)
    assert layout == {n: list(s.shape) for n, s in dummy.specs.items()}
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(layout)
