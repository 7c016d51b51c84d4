"""`sluice chat`: an interactive conversation. The history is sent whole each turn; when it outgrows the context
window the oldest turns are dropped (the system message stays), and the user is told. Ctrl-C during a reply stops
that reply; at the prompt it ends the session. /help, /reset, /quit and /exit are commands, not messages."""

from __future__ import annotations

import sys

from sluice.cli import utf8_text
from sluice.errors import ContextLengthError, InvalidOptionError

HELP = ("sluice chat — empty line, Ctrl-D, /quit or /exit to quit, /reset to start over, /help for this; Ctrl-C "
        "stops a reply.")


def _say(message: str) -> None:
    print(f"sluice: {message}", file=sys.stderr, flush=True)


def fit_history(model, messages: list[dict], reserve: int) -> tuple[list[dict], int]:
    """The messages with the oldest turns dropped until the prompt leaves `reserve` positions for the reply (or only
    the newest user message is left), and how many messages were dropped."""
    keep = 1 if messages and messages[0]["role"] == "system" else 0
    limit = model.engine.max_length - reserve
    dropped = 0
    while len(messages) - keep > 1 and len(model.encode_prompt(messages)) > limit:
        del messages[keep]
        dropped += 1
        while len(messages) - keep > 1 and messages[keep]["role"] != "user":  # a turn starts with the user
            del messages[keep]
            dropped += 1
    return messages, dropped


def chat(model, system: str | None, max_tokens: int, sampling: dict, read=input) -> int:
    messages = [{"role": "system", "content": system}] if system else []
    window = model.engine.max_length
    reserve = max(1, min(max_tokens, window // 4))  # room kept for a reply when old turns are dropped
    print(HELP, file=sys.stderr)
    while True:
        try:
            line = read("> ")
        except EOFError:
            print()
            return 0
        command = line.strip()
        if not command or command in ("/quit", "/exit"):
            return 0
        if command == "/help":
            print(HELP, file=sys.stderr)
            continue
        if command == "/reset":
            messages = messages[:1] if system else []
            _say("conversation cleared" + (" (the system message stays)." if system else "."))
            continue
        try:
            utf8_text(line, "that message")
        except InvalidOptionError as e:
            _say(f"{e} Send it again.")
            continue
        messages.append({"role": "user", "content": line})
        messages, dropped = fit_history(model, messages, reserve)
        if dropped:
            _say(f"the conversation outgrew the {window}-token context window: dropped the oldest {dropped} "
                 f"message{'s' if dropped > 1 else ''}.")
        reply, seq = [], None
        outputs = model.outputs(messages, max_tokens=max_tokens, **sampling)
        try:
            for out in outputs:
                sys.stdout.write(out.text)
                sys.stdout.flush()
                reply.append(out.text)
                seq = out.seq
        except KeyboardInterrupt:
            outputs.close()  # aborts the request: its cache row is free
            sys.stdout.write(" [stopped]")
        except ContextLengthError as e:
            messages.pop()  # the message alone does not fit: forget it, keep the session
            _say(f"that message is too long for the context window ({e}); send a shorter one.")
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        if seq is not None and seq.finish_reason == "length" and seq.max_tokens < max_tokens:
            _say("the reply reached the end of the context window; the oldest turns will be dropped next time.")
        messages.append({"role": "assistant", "content": "".join(reply)})
