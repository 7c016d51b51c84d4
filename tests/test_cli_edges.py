"""The rough edges a new user hit with the `sluice` command: clean failures (status 2, one line, no traceback), an
unwritable SLUICE_HOME, `| head`, --version and help, `info --model`, convert's messages, saying when the context
window ends a reply, bench's progress, and `sluice chat` (old turns dropped, Ctrl-C stops a reply, /reset)."""

import io
import os
import subprocess
import sys

import pytest

from helpers import save_hf_dir, tiny_llama
from sluice.cli import build_parser, main


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama HF directory: context window 256, byte-level tokenizer."""
    return save_hf_dir(tiny_llama(seed=4), tmp_path_factory.mktemp("cli") / "llama")


def sluice_cmd(*args, **kw):
    return subprocess.run([sys.executable, "-m", "sluice", *map(str, args)], capture_output=True, text=True,
                          timeout=300, **kw)


def test_clean_failures_exit_2_with_one_line(tiny, tmp_path, capsys):
    cases = [["run", "hi", "--model", str(tmp_path / "nowhere")],
             ["info", "--model", str(tmp_path / "nowhere")],
             ["info", str(tiny), "--model", str(tmp_path / "other")],
             ["run", "hi", "--model", str(tiny), "--temperature", "-1"]]
    for argv in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("sluice: error: ") and "\n" not in err and "Traceback" not in err, err
    proc = sluice_cmd("run", "hi", "--model", tmp_path / "nowhere")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stderr.startswith("sluice: error:")


def test_convert_says_what_is_wrong(tiny, demo_gguf_path, tmp_path, capsys):
    assert main(["convert", str(tmp_path / "nowhere"), str(tmp_path / "out")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["convert", str(demo_gguf_path), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "is a GGUF file" in err and "needs no conversion" in err
    assert main(["convert", str(tiny), str(tmp_path / "out")]) == 2  # Llama: not supported, said so
    assert "not supported" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["convert", str(tiny), str(tmp_path / "out"), "--bits", "7"])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_converted_mlx_directory_is_labelled_mlx(tmp_path, capsys):
    from test_qwen3_next import qwen3_next, save

    src = save(qwen3_next(seed=11), tmp_path / "hf")
    assert main(["convert", str(src), str(tmp_path / "mlx")]) == 0
    capsys.readouterr()
    assert main(["info", "--model", str(tmp_path / "mlx")]) == 0
    out = capsys.readouterr().out
    assert "(mlx)" in out and "0.0 M" not in out and "4-bit affine, group 64" in out
    assert main(["info", str(src)]) == 0  # positional still works
    out = capsys.readouterr().out
    assert "(hf)" in out and "0.0 M" not in out


def test_version_and_help_for_every_option(capsys):
    import sluice

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and sluice.__version__ in capsys.readouterr().out
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command").choices
    for name, sub in subparsers.items():
        for action in sub._actions:
            assert action.help, f"sluice {name} {action.option_strings or action.dest} has no help text"
    bits = next(a for a in subparsers["convert"]._actions if a.dest == "bits")
    assert "2, 3, 4, 5, 6 or 8" in bits.help


def test_unwritable_sluice_home_falls_back(tiny, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = {**os.environ, "SLUICE_HOME": str(blocker / "home"), "OMP_NUM_THREADS": "1"}  # under a file: no mkdir
    proc = sluice_cmd("run", "hi", "--model", tiny, "--max-tokens", "2", env=env)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "cannot write to" in proc.stderr and "SLUICE_HOME" in proc.stderr


@pytest.mark.parametrize("argv", [["info", "--json"], ["run", "Once upon a time", "--max-tokens", "200"]])
def test_closed_pipe_is_quiet(tiny, argv):
    proc = subprocess.Popen([sys.executable, "-m", "sluice", *argv, "--model", str(tiny)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"})
    proc.stdout.close()  # `| head` that has read all it wants
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) in (0, 141) and "Traceback" not in err and "BrokenPipe" not in err, err


def test_run_says_when_the_context_window_ends_it(tiny, capsys):
    prompt = "ab" * 125  # 250 byte tokens of a 256-position window
    assert main(["run", prompt, "--model", str(tiny), "--max-tokens", "50", "--temperature", "0"]) == 0
    err = capsys.readouterr().err
    assert "the context window (256 positions" in err and "--max-tokens 50 was not reached" in err


def test_bench_shows_progress(tiny, capsys):
    assert main(["bench", "--model", str(tiny), "--prompt-tokens", "8", "--gen-tokens", "2", "--repeats", "1"]) == 0
    err = capsys.readouterr().err
    assert "sluice: bench: loading" in err and "dense KV cache: done in" in err


def chat(argv, lines, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(line + "\n" for line in lines)))
    status = main(["chat", *argv])
    return status, capsys.readouterr()


def test_chat_drops_the_oldest_turns_when_the_window_is_full(tiny, monkeypatch, capsys):
    turns = [f"message {i}: " + "xy" * 30 for i in range(6)]  # ~60+ tokens each, the window holds 256
    status, out = chat(["--model", str(tiny), "--max-tokens", "8", "--temperature", "0", "--system", "Be brief."],
                       turns + [""], monkeypatch, capsys)
    assert status == 0, out.err
    assert "outgrew the 256-token context window: dropped the oldest" in out.err and "prompt" not in out.err
    assert out.out.count("> ") >= len(turns)


def test_chat_rejects_one_overlong_message_and_goes_on(tiny, monkeypatch, capsys):
    status, out = chat(["--model", str(tiny), "--max-tokens", "4", "--temperature", "0"],
                       ["z" * 400, "hello", ""], monkeypatch, capsys)
    assert status == 0 and "too long for the context window" in out.err


def test_chat_ctrl_c_stops_the_reply_and_reset_confirms(tiny, monkeypatch, capsys):
    from sluice.engine.model import Model

    real = Model.outputs

    def interrupted(self, *args, **kwargs):
        gen = real(self, *args, **kwargs)
        yield next(gen)
        gen.close()
        raise KeyboardInterrupt

    monkeypatch.setattr(Model, "outputs", interrupted)
    status, out = chat(["--model", str(tiny), "--max-tokens", "8", "--temperature", "0"],
                       ["first", "/reset", "second", ""], monkeypatch, capsys)
    assert status == 0 and out.out.count("[stopped]") == 2  # both replies stopped, the session went on
    assert "conversation cleared" in out.err


def test_openmp_threads_sleep_while_waiting_unless_told_otherwise():
    """Spinning OpenMP waiters collapse decode on a shared machine: the CLI asks for passive waiting before torch
    (whose libgomp sluice's kernels share) is loaded, and keeps a policy the user set."""
    code = "import os, sys, sluice.cli; print(os.environ['OMP_WAIT_POLICY'], 'torch' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.split() == ["passive", "False"]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**env, "OMP_WAIT_POLICY": "active"}).stdout
    assert out.split() == ["active", "False"]


def test_chat_real_ctrl_c_mid_reply(demo_gguf_path):
    """SIGINT while the demo model is replying: the reply stops, the next question is answered."""
    import select
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "sluice", "chat", "--model", str(demo_gguf_path), "--temperature",
                             "0", "--max-tokens", "400"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdin.write(b"Write a long story about a dragon.\n")
    proc.stdin.flush()
    shown, deadline = b"", time.monotonic() + 120
    while shown.count(b" ") < 15 and time.monotonic() < deadline:  # the reply is under way
        if select.select([proc.stdout], [], [], 5)[0]:
            shown += os.read(proc.stdout.fileno(), 1000)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    out, err = proc.communicate(b"What is the capital of France?\n\n", timeout=120)
    assert proc.returncode == 0 and "Traceback" not in err.decode(), err.decode()
    assert b"[stopped]" in shown + out and b"Paris" in out


def test_serve_on_a_port_in_use_fails_cleanly(tiny, capsys):
    import socket

    pytest.importorskip("uvicorn")
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        assert main(["serve", "--model", str(tiny), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "choose another --port" in err


def test_serve_takes_the_prefill_chunk_options(tiny, monkeypatch, capsys):
    import sluice.server

    pytest.importorskip("uvicorn")
    served = []
    monkeypatch.setattr(sluice.server, "serve", lambda model, config: served.append(model))
    argv = ["serve", "--model", str(tiny), "--port", "0"]
    assert main([*argv, "--prefill-chunk", "128", "--decode-prefill-chunk", "32"]) == 0
    config = served[0].engine_config
    assert (config.prefill_chunk, config.decode_prefill_chunk, config.max_seq_len) == (128, 32, 256)
    assert main([*argv, "--decode-prefill-chunk", "-3"]) == 2
    assert "decode_prefill_chunk=-3" in capsys.readouterr().err


def test_unquantized_mlx_directory_is_labelled_mlx(tmp_path, capsys):
    """mlx-lm marks its safetensors {"format": "mlx"} whether or not it quantized them: the label follows the files,
    not the weights' kind."""
    from helpers import save_hf_dir, tiny_llama
    from safetensors.torch import load_file, save_file

    path = save_hf_dir(tiny_llama(seed=4), tmp_path / "m")
    for f in path.glob("*.safetensors"):
        save_file(load_file(f), f, metadata={"format": "mlx"})
    assert main(["info", "--model", str(path)]) == 0
    out = capsys.readouterr().out
    assert "(mlx)" in out and "affine" not in out


def test_text_that_is_not_utf8_is_refused_cleanly(tiny):
    """Bytes that are not UTF-8, as an argument, piped into run, or as a line of chat: one clear message, no
    traceback; chat goes on with the next line."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    base = [sys.executable, "-m", "sluice"]
    proc = subprocess.run([*base, "run", b"caf\xe9 au lait", "--model", str(tiny), "--max-tokens", "2"],
                          capture_output=True, env=env, timeout=300)
    err = proc.stderr.decode()
    assert proc.returncode == 2 and "not valid UTF-8 (byte 0xe9 at character 3)" in err and "Traceback" not in err
    proc = subprocess.run([*base, "run", "--model", str(tiny), "--max-tokens", "2"], input=b"caf\xe9 au lait",
                          capture_output=True, env=env, timeout=300)
    err = proc.stderr.decode()
    assert proc.returncode == 2 and "standard input is not valid UTF-8" in err and "Traceback" not in err
    proc = subprocess.run([*base, "chat", "--model", str(tiny), "--max-tokens", "2", "--temperature", "0"],
                          input=b"caf\xe9\nhello\n\n", capture_output=True, env=env, timeout=300)
    err = proc.stderr.decode()
    assert proc.returncode == 0 and "that message is not valid UTF-8" in err and "Traceback" not in err, err
    assert proc.stdout.count(b"> ") == 3


@pytest.mark.parametrize("argv, needle", [
    (["serve", "--port", "99999"], "port=99999"),
    (["serve", "--port", "-1"], "port=-1"),
    (["serve", "--max-seq-len", "0"], "--max-seq-len 0: use a positive number"),
    (["serve", "--max-seq-len", "100000"], "more than the model's context window (256 positions)"),
    (["serve", "--max-batch", "0"], "--max-batch 0: use a positive number of sequences"),
    (["serve", "--max-body-mb", "-1"], "--max-body-mb -1: use a positive number of MiB"),
    (["serve", "--max-body-mb", "nan"], "--max-body-mb nan"),
    (["serve", "--read-timeout", "0"], "read_timeout=0"),
    (["serve", "--max-connections", "0"], "max_connections=0"),
    (["run", "hi", "--system", "Be brief."], "--system needs --chat"),
    (["run", "hi", "--temperature", "nan"], "temperature=nan"),
    (["run", "hi", "--temperature", "inf"], "temperature=inf"),
    (["run", "hi", "--top-k", str(2**63)], "top_k=9223372036854775808"),
    (["run", "hi", "--repetition-penalty", "nan"], "repetition_penalty=nan"),
    (["chat", "--top-p", "nan"], "top_p=nan"),
])
def test_bad_values_fail_cleanly(tiny, monkeypatch, capsys, argv, needle):
    import sluice.server

    pytest.importorskip("uvicorn")
    monkeypatch.setattr(sluice.server, "serve", lambda model, config: pytest.fail("it served"))
    assert main([*argv, "--model", str(tiny)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sluice: error: ") and needle in err and "\n" not in err.strip(), err


def test_model_paths_that_are_not_models(tmp_path, capsys):
    one = tmp_path / "model.safetensors"
    one.write_bytes(bytes(16))
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    for path, needle in ((one, f"is one file of a checkpoint; pass the directory that holds it with config.json, "
                               f"*.safetensors and tokenizer.json ({tmp_path})"),
                         ("/dev/null", "/dev/null is not a regular file or a directory"),
                         (notes, "not a GGUF file")):
        assert main(["run", "hi", "--model", str(path)]) == 2
        err = capsys.readouterr().err
        assert needle in err and "download" not in err.lower(), err


def test_chat_commands_are_not_sent(tiny, monkeypatch, capsys):
    from sluice.engine.model import Model

    sent, real = [], Model.outputs

    def recorded(self, messages, *args, **kwargs):
        sent.append(messages[-1]["content"])
        return real(self, messages, *args, **kwargs)

    monkeypatch.setattr(Model, "outputs", recorded)
    for quit_command in ("/quit", "/exit"):
        sent.clear()
        status, out = chat(["--model", str(tiny), "--max-tokens", "2", "--temperature", "0"],
                           ["/help", "hello", quit_command, "never read"], monkeypatch, capsys)
        assert status == 0 and sent == ["hello"]
        assert out.err.count("/reset to start over") == 2  # at the start, and for /help
