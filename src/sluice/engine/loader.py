"""`sluice.load`: open a checkpoint (GGUF file, HF or MLX directory, or dummy weights from a config.json), build
the architecture's model on its device with every tensor put there as it is read, and wrap it in a `Model` with its
engine settings."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from sluice.config import EngineConfig
from sluice.engine.model import Model
from sluice.errors import InvalidOptionError, ModelFileError, UnsupportedError
from sluice.experts.placement import is_routed_expert, parse_bytes, place, streams


def _resolve_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InvalidOptionError(f"device={device!r} is not a device; use 'cpu' or 'cuda'.") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidOptionError("device 'cuda' was asked for but PyTorch sees no CUDA GPU; use --device cpu.")
    if dev.type not in ("cpu", "cuda"):
        raise InvalidOptionError(f"device {device!r} is not supported; use 'cpu' or 'cuda'.")
    return dev


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def _resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise InvalidOptionError(f"dtype={dtype!r} is not supported; use float32, bfloat16 or float16.")


LOAD_FORMATS = ("auto", "dummy")
_WHAT_TO_PASS = ("Pass a .gguf file or a model directory (config.json + *.safetensors + tokenizer.json), or omit "
                 "--model for the demo model.")


def open_source(path, load_format: str = "auto"):
    """The checkpoint reader for a path: a GGUFFile or an HFDirectory ("auto"), or a DummyCheckpoint over the
    config.json at `path` (a config file or its directory) for "dummy"."""
    from sluice.formats.gguf import GGUFFile
    from sluice.formats.hf import HFDirectory

    p = Path(path).expanduser()
    if load_format == "dummy":
        from sluice.formats.dummy import DummyCheckpoint

        return DummyCheckpoint(p)
    if p.is_dir():
        return HFDirectory(p)
    if p.is_file() and p.suffix.lower() in (".safetensors", ".json"):
        raise ModelFileError(f"{p} is one file of a checkpoint; pass the directory that holds it with config.json, "
                             f"*.safetensors and tokenizer.json ({p.parent}), or a .gguf file.")
    if p.is_file():
        return GGUFFile(p)
    if p.exists():  # /dev/null, a FIFO
        raise ModelFileError(f"{p} is not a regular file or a directory. {_WHAT_TO_PASS}")
    raise ModelFileError(f"{p}: no such file or directory. {_WHAT_TO_PASS}")


class _DeviceReader:
    """The checkpoint reader the builders see while a model loads: each tensor comes back on the target device as
    it is read (readers with `reads_to_device` put it there themselves; GGUF tensors are moved one by one), so
    the model never exists whole on the host. A tqdm bar of the bytes read, on a terminal only."""

    def __init__(self, src, device: torch.device, total_bytes: int, expert_store: str | None = None):
        from tqdm import tqdm

        self.src, self.device, self.expert_store = src, device, expert_store
        self.streamed_prefixes: list[str] = []  # the MoE layers whose experts stay on disk, in the order read
        self.direct = getattr(src, "reads_to_device", False)
        tp = getattr(src, "tp", None)  # a tensor-parallel group shows rank 0's bar alone
        self.bar = tqdm(total=total_bytes, desc="loading", unit="B", unit_scale=True, unit_divisor=1024,
                        leave=False, disable=not sys.stderr.isatty() or (tp is not None and tp.rank != 0))

    def __getattr__(self, name):
        return getattr(self.src, name)

    def tensor(self, name: str):
        if self.expert_store == "disk" and is_routed_expert(name):  # read later from the files: shapes only
            prefix = name[: name.index("switch_mlp.")] if "switch_mlp." in name else name
            if prefix not in self.streamed_prefixes:
                self.streamed_prefixes.append(prefix)
            t = self.src.tensor(name, "cpu").to("meta")  # zero-copy views: nothing read
        elif self.expert_store == "host" and is_routed_expert(name):  # streamed experts live in host memory
            # dummy weights are made fast on the device, then moved; checkpoints are read to the host directly
            made = self.src.tensor(name, self.device if self.src.format == "dummy" else "cpu")
            t = made.to("cpu")
        elif self.direct:
            t = self.src.tensor(name, self.device)
        else:
            t = self.src.tensor(name).to(self.device)
        self.bar.update(t.nbytes)
        return t

    def close(self) -> None:
        """End the bar and release the source's read buffers (tensors already read stay valid)."""
        self.bar.close()
        if hasattr(self.src, "close"):
            self.src.close()


ENGINE_OPTIONS = ("max_batch", "max_seq_len", "prefill_chunk", "decode_prefill_chunk", "graphs", "graph_batch_sizes",
                  "graph_token_sizes", "whole_graph_tokens", "overlap", "deterministic",
                  "prefix_cache", "kv_page", "kv_blocks")


def _read_checkpoint(path, load_format: str, dev: torch.device, dt: torch.dtype, gpu_memory, expert_slots,
                     expert_store: str, config: EngineConfig | None = None):
    """(source, module, tokenizer) of the checkpoint at `path`, its weights read onto `dev` (the routed experts
    into host memory when they stream: `experts.placement`)."""
    from sluice.formats.tokenizer import Tokenizer
    from sluice.models import architecture_module
    from sluice.parallel import launch

    src = open_source(path, load_format)
    src.tp = launch.LOADING  # this rank's part of a tensor-parallel model (None: the whole model): the builders split
    store = streams(src, dev, gpu_memory, expert_slots, expert_store)
    if src.tp is not None and src.tp.expert_parallel and store is not None:
        raise UnsupportedError("expert_parallel with streamed experts is not supported yet, and this model's share "
                               "of the experts does not fit the device memory: use more GPUs, or tensor_parallel "
                               "without expert_parallel (its experts stream from host memory).")
    if src.tp is not None and store == "disk":
        raise UnsupportedError("tensor_parallel streams experts from host memory only, yet, and this host's memory "
                               "cannot hold them; use more GPUs, or one process with expert_store='disk'.")
    name = src.architecture if src.format == "gguf" else src.config.get("model_type", "<missing model_type>")
    if src.tp is not None and not getattr(architecture_module(name), "TENSOR_PARALLEL", False):
        raise UnsupportedError(f"tensor_parallel is not supported for {name!r} models yet.")
    if src.format == "gguf":
        arch = architecture_module(src.architecture)
        tokenizer = Tokenizer.from_gguf(src.fields)
        reader = _DeviceReader(src, dev, src.total_bytes)
        build = arch.build_from_gguf
    else:
        arch = architecture_module(src.config.get("model_type", "<missing model_type>"))
        tokenizer = src.tokenizer() if src.format == "dummy" else Tokenizer.from_hf_dir(src.path)
        reader = _DeviceReader(src, dev, src.total_bytes, store)
        build = arch.build_from_hf
    try:
        module = build(reader, dt)
    finally:
        reader.close()
    disk = (src, reader.streamed_prefixes) if store == "disk" else None
    reserve = None if config is None or gpu_memory is None else _cache_reserve(module, config, dev, dt)
    module.placement = place(module, dev, gpu_memory, expert_slots, disk, reserve) if store else None
    return src, module, tokenizer


def _cache_reserve(module, config: EngineConfig, dev: torch.device, dt: torch.dtype) -> int:
    """Bytes a device memory budget keeps beside the weights and expert slots (`engine/memory.py`): activations and
    graphs, `max_batch` rows, and KV for each row's first 4,096 positions or one sequence at its longest, whichever
    is more (a paged cache); whole rows of the longest length otherwise."""
    from sluice.engine.memory import ACTIVATION_RESERVE

    cfg = module.cfg
    longest = min(cfg.context_length, config.max_seq_len or cfg.context_length)
    page, rows = config.page(dev), config.max_batch
    blocks = max(-(-longest // page), rows * -(-min(longest, 4096) // page)) if page else None
    pool = module.new_cache(rows, longest, dt, "meta", config.kv_cache, page=page, blocks=blocks)
    return ACTIVATION_RESERVE + pool.nbytes() + (rows + 1) * cfg.vocab_size


def load(path=None, device=None, dtype=None, keep_quantized: bool = True, kv_cache: str = "dense",
         load_format: str = "auto", gpu_memory=None, expert_slots: int | None = None, expert_store: str = "auto",
         tensor_parallel: int = 1, expert_parallel: bool = False, **options) -> Model:
    """Load a GGUF file or an HF/MLX directory (None: the demo model) onto `device`, tensor by tensor. Quantized
    weights stay packed unless keep_quantized=False, which dequantizes them once to `dtype` (more memory; dense
    matmuls). kv_cache: "dense" (K/V in `dtype`) or "turboquant4" (4-bit codes of the rotated vectors + a scale
    each: ~3.8x smaller). load_format: "auto" (the checkpoint at `path`) or "dummy" (`path` is a config.json or
    its directory; random weights at the shapes and bit widths of that config's MLX checkpoint, made on the device:
    `sluice.formats.dummy`). gpu_memory (bytes, or a size such as "24GiB"): the device memory the model may use;
    when it does not fit, its routed experts stay in host memory and each MoE layer keeps the slots that fit on the
    device (`sluice.experts`; without it, a model bigger than the free GPU memory streams the same way).
    expert_slots: that many slots a layer, whatever the budget. expert_store: where streamed experts stay: "auto"
    (host memory when they fit there, else the checkpoint's files), "host" or "disk". Engine options
    (`sluice.config.EngineConfig`): max_batch, max_seq_len, prefill_chunk, decode_prefill_chunk, graphs,
    graph_batch_sizes, graph_token_sizes, whole_graph_tokens, overlap, deterministic, prefix_cache, kv_page,
    kv_blocks. tensor_parallel: split the weights across that many ranks, one process each (one GPU each on
    CUDA; gloo ranks on the CPU: `sluice.parallel`); `Model.close()` stops them. expert_parallel: with
    tensor_parallel, the routed experts split whole across the ranks instead of each expert's intermediate size."""
    from sluice.parallel import launch

    run = launch.torchrun()
    if run is not None and run[1] > 1 and tensor_parallel == 1 and launch.LOADING is None:
        raise InvalidOptionError(f"torchrun started {run[1]} processes but tensor_parallel is 1: give "
                                 f"--tensor-parallel {run[1]} (tensor_parallel={run[1]}) to split the model across "
                                 "them.")
    if expert_parallel and tensor_parallel == 1:
        raise InvalidOptionError("expert_parallel splits the experts across the ranks of tensor_parallel; give "
                                 "tensor_parallel (--tensor-parallel) as well.")
    if tensor_parallel != 1 and launch.LOADING is None:  # this process becomes rank 0 and starts the others
        if expert_store == "disk" or (expert_parallel and (gpu_memory is not None or expert_slots is not None)):
            raise InvalidOptionError("tensor_parallel streams experts from host memory only, and not with "
                                     "expert_parallel, yet: drop expert_store='disk' (or expert_parallel).")
        return launch.start(tensor_parallel, dict(
            path=path, device=device, dtype=dtype, keep_quantized=keep_quantized, kv_cache=kv_cache,
            load_format=load_format, tensor_parallel=tensor_parallel, expert_parallel=expert_parallel,
            gpu_memory=gpu_memory, expert_slots=expert_slots, expert_store=expert_store, **options))
    unknown = sorted(set(options) - set(ENGINE_OPTIONS))
    if unknown:
        raise InvalidOptionError(f"unknown load option(s): {', '.join(unknown)}.")
    if load_format not in LOAD_FORMATS:
        raise InvalidOptionError(f"load_format={load_format!r}: use one of {', '.join(map(repr, LOAD_FORMATS))}.")
    config = EngineConfig(kv_cache=kv_cache, **options)
    if path is None:
        if load_format == "dummy":
            raise InvalidOptionError("load_format='dummy' needs a path: a config.json or the directory holding it.")
        from sluice.formats.demo import demo_model_path

        path = demo_model_path()
    dev = _resolve_device(device)
    dt = _resolve_dtype(dtype, dev)
    if gpu_memory is not None:
        gpu_memory = parse_bytes(gpu_memory)
    if expert_slots is not None and (not isinstance(expert_slots, int) or isinstance(expert_slots, bool)):
        raise InvalidOptionError(f"expert_slots={expert_slots!r}: use an integer.")
    if not keep_quantized and (expert_slots is not None or expert_store == "disk"):
        raise InvalidOptionError("keep_quantized=False cannot be combined with streamed experts.")
    try:
        src, module, tokenizer = _read_checkpoint(path, load_format, dev, dt, gpu_memory, expert_slots,
                                                  expert_store, config)
    except ModelFileError as e:  # every load error names the file it is about
        if str(path) in str(e):
            raise
        raise ModelFileError(f"{path}: {e}") from e
    if not keep_quantized:
        if module.placement is not None:
            raise InvalidOptionError("keep_quantized=False cannot be combined with streamed experts.")
        for mod in module.modules():
            if hasattr(mod, "dequantize_"):
                mod.dequantize_(dt)
        if module.cfg.tie_word_embeddings:  # share the one dense copy again
            if getattr(module, "tp", None) is None:
                module.lm_head = module.embed.as_linear()
            else:  # a rank's vocabulary shard, inside its wrappers
                module.lm_head.head = module.embed.embedding.as_linear()
    if tokenizer.vocab_size > module.cfg.vocab_size:  # ids past the embedding would be read out of bounds
        raise ModelFileError(f"{path}: the tokenizer has {tokenizer.vocab_size} tokens but the model's embedding "
                             f"only {module.cfg.vocab_size} rows; the tokenizer and the weights do not belong "
                             "together.")
    try:  # a cache kind the model cannot use is the user's error, said before any generation
        module.check_cache_kind(kv_cache)
    except ValueError as e:
        raise UnsupportedError(f"kv_cache={kv_cache!r}: {e}; use kv_cache='dense'.") from e
    module.eval().to(dev)  # what the builders made themselves (e.g. RoPE frequencies); the weights are there
    module.memory_budget = gpu_memory  # the user's device budget, if any: the runner keeps no spare rows then
    return Model(module, tokenizer, Path(path), src.format, dev, dt, config)
