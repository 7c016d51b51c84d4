"""The demo model (SmolLM2-135M-Instruct, Q4_1 GGUF) end to end on the CPU."""

import pytest
import torch

import sluice
from sluice.cli import main


@pytest.fixture(scope="module")
def model(demo_gguf_path):
    return sluice.load(demo_gguf_path, device="cpu")


def test_capital_of_france(model):
    out = model.generate("The capital of France is", max_tokens=16, temperature=0)
    assert "Paris" in out


def test_cli_run_prints_paris(demo_gguf_path, capsys):
    assert main(["run", "The capital of France is", "--max-tokens", "16", "--temperature", "0",
                 "--model", str(demo_gguf_path)]) == 0
    assert "Paris" in capsys.readouterr().out


def test_chunked_prefill_and_decode_equal_full_forward(model):
    ids = model.tokenizer.encode("Rivers carry water from the mountains to the sea, and along the way they "
                                 "shape valleys, feed farms and give cities a reason to exist.")
    full = model.logits(ids)[0]
    cache = model.new_cache(len(ids))
    split = len(ids) - 5
    # chunks of 7 against a filled cache, then decode steps
    parts = [model.forward([ids[s:min(s + 7, split)]], cache, s)[0] for s in range(0, split, 7)]
    for t in range(split, len(ids)):
        parts.append(model.forward(torch.tensor([[ids[t]]]), cache, t, last_only=False)[0])
    got = torch.cat(parts)
    assert float((got - full).norm() / full.norm()) < 1e-5
    assert torch.equal(got.argmax(-1), full.argmax(-1))


def test_stream_equals_generate_and_chat_stops_at_end_of_turn(model):
    kw = dict(max_tokens=40, temperature=0, chat=True)
    pieces = list(model.stream("What is the capital of France?", **kw))
    text = "".join(pieces)
    assert text == model.generate("What is the capital of France?", **kw)
    assert "Paris" in text and "<|im_end|>" not in text


def test_seeded_sampling_is_reproducible(model):
    kw = dict(max_tokens=12, temperature=0.9, top_p=0.95, top_k=40, seed=1234)
    a, b = model.generate("Once upon a time", **kw), model.generate("Once upon a time", **kw)
    assert a == b
    outs = {model.generate("Once upon a time", **{**kw, "seed": s}) for s in range(4)}
    assert len(outs) > 1


def test_logits_shape_and_dtype(model):
    ids = model.tokenizer.encode("Hello world")
    logits = model.logits(ids)
    assert logits.shape == (1, len(ids), model.config.vocab_size) and logits.dtype == torch.float32


def test_agreement_with_llama_cpp(model, demo_gguf_path):
    """Teacher-forced top-1 agreement with llama.cpp on the same GGUF (the full 1,500-token measurement is
    `python -m benchmarks run llamacpp_agreement`)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    import numpy as np
    from pydoc_data.topics import topics

    ids = model.tokenizer.encode(topics["execmodel"])[:300]
    ours = model.logits(ids)[0].numpy()
    llm = llama_cpp.Llama(model_path=str(demo_gguf_path), n_ctx=512, n_threads=2, logits_all=True, verbose=False)
    llm.eval(ids)
    ref = np.asarray(llm.scores[: len(ids)])
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.95


def test_pure_torch_path_matches_native_kernels(model, demo_gguf_path, tmp_path):
    """SLUICE_CPU_KERNEL=0 (no C compiler) runs the torch references end to end, with the same results."""
    import os
    import subprocess
    import sys

    import numpy as np

    ids = model.tokenizer.encode("The capital of France is")
    out = tmp_path / "logits.npy"
    code = ("import sys, numpy as np, sluice; from sluice.kernels import cpu; assert not cpu.available(); "
            f"m = sluice.load({str(demo_gguf_path)!r}, device='cpu'); "
            f"np.save({str(out)!r}, m.logits({ids})[0].numpy()); "
            "print(m.generate('The capital of France is', max_tokens=3, temperature=0))")
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "SLUICE_CPU_KERNEL": "0"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    ref = torch.from_numpy(np.load(out, allow_pickle=False))
    ours = model.logits(ids)[0]
    assert float((ours - ref).norm() / ref.norm()) < 1e-5


def test_dequantized_weights_give_the_same_logits(model, demo_gguf_path):
    dense = sluice.load(demo_gguf_path, device="cpu", keep_quantized=False)
    assert not any(getattr(m, "qweight", None) is not None for m in dense.module.modules())
    ids = model.tokenizer.encode("The capital of France is")
    a, b = model.logits(ids), dense.logits(ids)
    assert float((a - b).norm() / b.norm()) < 1e-5
