"""Shared pieces of the CPU benchmarks: the evaluation text and the llama.cpp peer."""

from __future__ import annotations

import hashlib
import sys


def public_text() -> tuple[str, str]:
    """A public prose text of > 1,000 tokens available offline on every machine: the "Execution model"
    chapter of the Python Language Reference, as shipped in CPython's pydoc_data. Returns (text, label)."""
    from pydoc_data.topics import topics

    text = topics["execmodel"]
    label = (f"Python {sys.version.split()[0]} pydoc_data topics['execmodel'] "
             f"(sha256 {hashlib.sha256(text.encode()).hexdigest()[:12]})")
    return text, label


def llama_cpp_model(path, n_ctx: int, logits_all: bool = False, threads: int = 2):
    try:
        from llama_cpp import Llama
    except ImportError:
        sys.exit("llama-cpp-python is needed for this comparison: pip install llama-cpp-python "
                 "(builds llama.cpp from source, ~10 minutes on 2 cores)")
    return Llama(model_path=str(path), n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads,
                 logits_all=logits_all, verbose=False)
