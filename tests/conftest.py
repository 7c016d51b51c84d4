import os

import pytest
import torch

# Without a GPU, Triton kernels run under the interpreter (must be set before triton is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest-xdist's workers share the cores: each takes its share of torch's threads. With every worker on all the cores,
# OpenMP's waiting threads spin against each other and CPU engine tests run many times slower.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ and "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(max(1, torch.get_num_threads() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.fixture(scope="session")
def demo_gguf_path():
    """Path of the demo GGUF (fetched into the sluice cache on first use)."""
    from sluice.formats.demo import demo_model_path

    return demo_model_path(quiet=True)


# `pytest -m "not slow"`: a quick subset (README). Slow are the kernel tests that run under the Triton interpreter
# when there is no GPU (on a GPU they are quick and the point), the fuzz campaign, and the tests named below.
INTERPRETED = {"test_attention_triton", "test_conv1d_triton", "test_gdn_triton", "test_group_route_triton",
               "test_kernel_rows", "test_mla_triton", "test_moe_kernels", "test_norm_triton", "test_qmatmul_triton",
               "test_rope_triton", "test_turboquant_paged", "test_fuzz"}
SLOW = {"test_batch_equals_each_sequence_alone", "test_gdn_triton_kernels_in_the_layer",
        "test_gated_attention_layer_through_the_fused_kernels", "test_ctrl_c_with_a_stream_in_flight",
        "test_load_memory_benchmark_at_a_tiny_size", "test_pure_torch_path_matches_native_kernels",
        "test_mla_and_moe_kernels_compile_for_sm90_at_real_shapes"}


# tiny checkpoints of the three architectures (seeded), for the engine tests that compare paths
@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    from helpers import save_hf_dir, tiny_llama

    return save_hf_dir(tiny_llama(seed=3), tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory):
    from test_qwen3_next import qwen3_next, save

    return save(qwen3_next(seed=5), tmp_path_factory.mktemp("qwen"))


@pytest.fixture(scope="session")
def deepseek_dir(tmp_path_factory):
    from test_deepseek import save, v3

    return save(v3(seed=5, num_hidden_layers=2), tmp_path_factory.mktemp("deepseek") / "m")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: left out by the quick subset, pytest -m 'not slow'")


def pytest_collection_modifyitems(config, items):
    gpu = torch.cuda.is_available()
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]
        if (module in INTERPRETED and not gpu) or item.originalname in SLOW:
            item.add_marker(pytest.mark.slow)
