import pytest


@pytest.fixture(scope="session")
def demo_gguf_path():
    """Path of the demo GGUF (fetched into the sluice cache on first use)."""
    from sluice.formats.demo import demo_model_path

    return demo_model_path(quiet=True)
