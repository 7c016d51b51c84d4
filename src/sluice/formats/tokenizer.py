"""Tokenizers: byte-level BPE from GGUF metadata (the way llama.cpp reads it) or an HF `tokenizer.json`.

Both paths end in a real `tokenizers.Tokenizer` (the Rust HF library) built in memory; this module adds what
an inference engine needs around it: BOS/EOS policy, end-of-generation ids, chat templates and a streaming
detokenizer that never emits half a UTF-8 character.

GGUF: only `tokenizer.ggml.model == "gpt2"` (byte-level BPE) is supported. The pre-tokenizer regexes for
`tokenizer.ggml.pre` are transcribed from llama.cpp (`src/llama-vocab.cpp`): `formats/pretokenizers.py`.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
import threading
import warnings
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Mapping

from sluice.errors import InvalidOptionError, ModelFileError, SluiceError, UnsupportedError
from sluice.formats.pretokenizers import pre_for
from sluice.formats.validate import is_rust_panic, untrusted

REPLACEMENT_CHAR = "\ufffd"
_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(text: str, what: str) -> None:
    """Refuse a str holding a lone UTF-16 surrogate (JSON's "\\ud800", or undecodable bytes Python kept as
    surrogates): it is not text, and the tokenizer cannot take it."""
    bad = _SURROGATE.search(text)
    if bad:
        raise InvalidOptionError(f"{what} is not valid Unicode: it holds a lone surrogate U+{ord(bad.group()):04X} at "
                                 f"character {bad.start()}; send UTF-8 text.")

# GGUF token types (llama.cpp's llama_token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# Token texts llama.cpp treats as end-of-generation whatever the metadata says (llama-vocab.cpp, "special_eog_ids").
EOG_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
)
# llama.cpp also ends generation on the FIM pad / repo / file-separator tokens, found by these texts
_FIM_EOG_TEXTS = {
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}

# --- GGUF metadata ---

def _field(fields: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """The value of a GGUF metadata key from `GGUFReader.fields` (plain Python values are accepted too)."""
    f = fields.get(key)
    if f is None:
        return default
    if not hasattr(f, "contents"):
        return f
    try:
        value = f.contents()
    except UnicodeDecodeError:  # a token that is not valid UTF-8: decode it lossily, like llama.cpp would print it
        value = _lossy_strings(f)
    if getattr(value, "ndim", None) is not None:  # numpy scalar or array
        value = value.item() if value.ndim == 0 else value.tolist()
    return value


def _lossy_strings(f) -> Any:
    strs = [bytes(f.parts[i]).decode("utf-8", errors="replace") for i in f.data]
    return strs if len(f.types) > 1 else strs[0]


def _split_merge(m: str) -> tuple[str, str]:
    pos = m.find(" ", 1)  # llama.cpp splits at the first space after the first character
    if pos < 0:
        raise ModelFileError(f"GGUF tokenizer.ggml.merges entry {m!r} is not of the form 'left right'; the file is "
                             "corrupt. Download or convert it again.")
    return m[:pos], m[pos + 1:]


# --- the tokenizer ---

class Tokenizer:
    """Text <-> token ids for one model.

    Build with `Tokenizer.from_gguf(reader.fields)` or `Tokenizer.from_hf_dir(path)`.

    - `encode(text, add_special=True)`: ids; BOS (and EOS) are added iff the model asks for them and
      `add_special`. Special tokens written in the text (e.g. `<|im_start|>`) are matched whole, as llama.cpp
      does with `parse_special=True`; pass `parse_special=False` to tokenize them as plain text.
    - `decode(ids, skip_special=False)`, `stream_decoder()` for incremental decoding.
    - `vocab_size`, `bos_id`, `eos_id` (None when the model has none), `stop_ids` (end-of-generation ids).
    - `apply_chat_template(messages, add_generation_prompt=True)`: the model's Jinja chat template; when the
      model has none, a plain ChatML template is used (see `CHATML_TEMPLATE`). `encode_chat(messages)`: its text
      and ids, with special-token texts inside the messages tokenized as plain text (no role injection).
    """

    def __init__(self, hf_tokenizer, *, vocab_size: int, bos_id: int | None, eos_id: int | None,
                 stop_ids: Iterable[int] = (), add_bos: bool = False, add_eos: bool = False,
                 chat_template: str | None = None, bos_token: str | None = None, eos_token: str | None = None,
                 pre_tokenizer: str | None = None):
        self._tok = hf_tokenizer
        self.vocab_size = int(vocab_size)
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = bool(add_bos)
        self.add_eos = bool(add_eos)
        if self.add_bos and bos_id is None:
            raise ModelFileError("The tokenizer asks for a BOS token (add_bos_token is true) but defines none; "
                                 "the model files are inconsistent. Fix add_bos_token or the BOS token id.")
        if self.add_eos and eos_id is None:
            raise ModelFileError("The tokenizer asks for an EOS token (add_eos_token is true) but defines none; "
                                 "the model files are inconsistent. Fix add_eos_token or the EOS token id.")
        self.stop_ids: set[int] = {int(i) for i in stop_ids if i is not None and 0 <= int(i) < self.vocab_size}
        self.chat_template = chat_template
        self.bos_token = bos_token if bos_token is not None else self._text_of(bos_id)
        self.eos_token = eos_token if eos_token is not None else self._text_of(eos_id)
        self.pre_tokenizer = pre_tokenizer
        self._lock = threading.Lock()
        self._template = None
        self._plain_tok = None
        self._specials = None

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_id={self.eos_id}, "
                f"add_bos={self.add_bos}, stop_ids={sorted(self.stop_ids)})")

    @property
    def hf(self):
        """The underlying `tokenizers.Tokenizer`."""
        return self._tok

    def _text_of(self, token_id: int | None) -> str | None:
        return None if token_id is None else self._tok.id_to_token(int(token_id))

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_gguf(cls, fields: Mapping[str, Any]) -> "Tokenizer":
        """From GGUF metadata: pass `gguf.GGUFReader(path).fields` (the caller keeps the reader)."""
        with untrusted("the GGUF file's tokenizer metadata (tokenizer.ggml.*)"):
            return cls._from_gguf(fields)

    @classmethod
    def _from_gguf(cls, fields: Mapping[str, Any]) -> "Tokenizer":
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        kind = _field(fields, "tokenizer.ggml.model")
        if kind is None:
            raise ModelFileError("GGUF has no tokenizer (metadata key tokenizer.ggml.model is missing). Use a GGUF "
                                 "converted with its tokenizer, or a Hugging Face model directory.")
        if kind != "gpt2":
            what = {"llama": "SentencePiece ('llama')", "bert": "WordPiece ('bert')", "t5": "Unigram ('t5')",
                    "rwkv": "RWKV ('rwkv')"}.get(kind, f"'{kind}'")
            raise UnsupportedError(f"GGUF tokenizer type {what} is not supported yet; sluice supports byte-level "
                                   "BPE ('gpt2') vocabularies. Use a model with a BPE vocabulary, or the model's "
                                   "Hugging Face directory (tokenizer.json).")
        tokens = _field(fields, "tokenizer.ggml.tokens")
        if not tokens:
            raise ModelFileError("GGUF tokenizer has no vocabulary (tokenizer.ggml.tokens is missing or empty); "
                                 "the file is incomplete. Download or convert it again.")
        tokens = list(tokens)
        n = len(tokens)
        types = _field(fields, "tokenizer.ggml.token_type")
        types = [int(t) for t in types] if types is not None else [TOKEN_NORMAL] * n
        if len(types) < n:
            raise ModelFileError(f"GGUF tokenizer.ggml.token_type has {len(types)} entries for {n} tokens; the "
                                 "file is corrupt. Download or convert it again.")
        merges_raw = _field(fields, "tokenizer.ggml.merges")
        if merges_raw is None:
            # gguf's writer drops empty arrays, so a vocabulary without merges has no key at all. llama.cpp refuses
            # such a file; we accept it, and warn when the vocabulary has multi-character tokens BPE cannot reach.
            merges_raw = []
            if any(len(t) > 1 and types[i] == TOKEN_NORMAL for i, t in enumerate(tokens)):
                warnings.warn("GGUF BPE tokenizer has no merges (tokenizer.ggml.merges is missing): text will be "
                              "tokenized into single bytes. The file is probably incomplete; convert it again.",
                              stacklevel=2)
        pre_name, pre = pre_for(_field(fields, "tokenizer.ggml.pre"))

        for i, t in enumerate(tokens):
            if not t:
                tokens[i] = f"[EMPTY_{i}]"  # as llama.cpp does
        vocab = {t: i for i, t in enumerate(tokens)}
        if len(vocab) != n:
            seen: dict[str, int] = {}
            for i, t in enumerate(tokens):
                if t in seen:
                    raise ModelFileError(f"GGUF vocabulary has the token {t!r} twice (ids {seen[t]} and {i}); the "
                                         "file is corrupt. Download or convert it again.")
                seen[t] = i
        merges = [_split_merge(m) for m in merges_raw]
        try:
            model = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges, fuse_unk=False,
                               byte_fallback=False)
        except Exception as e:  # tokenizers raises plain Exceptions on inconsistent merges
            raise ModelFileError(f"GGUF BPE vocabulary and merges are inconsistent ({e}); the file is corrupt. "
                                 "Download or convert it again.") from e
        tok = HFTokenizer(model)
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()

        # Special-token ids from the metadata.
        def tid(key: str) -> int | None:
            v = _field(fields, f"tokenizer.ggml.{key}")
            if v is None:
                return None
            v = int(v)
            if not 0 <= v < n:
                warnings.warn(f"GGUF tokenizer.ggml.{key} = {v} is outside the vocabulary (size {n}); ignoring it.",
                              stacklevel=3)
                return None
            return v

        bos_id = tid("bos_token_id") if pre.has_bos else None
        eos_id, eot_id, eom_id = tid("eos_token_id"), tid("eot_token_id"), tid("eom_token_id")
        fim = {k: tid(f"{k}_token_id") for k in _FIM_EOG_TEXTS}
        add_bos = _field(fields, "tokenizer.ggml.add_bos_token")
        # llama.cpp's default (BOS for the llama3 family) applies only when there is a BOS token to add
        add_bos = (pre.add_bos and bos_id is not None) if add_bos is None else bool(add_bos)
        add_eos = bool(_field(fields, "tokenizer.ggml.add_eos_token", False))

        # End of generation, as llama.cpp decides it: metadata ids plus well-known texts.
        control = {i for i, t in enumerate(types[:n]) if t in (TOKEN_CONTROL, TOKEN_UNKNOWN)}
        by_text = {t: vocab[t] for t in EOG_TEXTS if t in vocab}
        for k, texts in _FIM_EOG_TEXTS.items():
            if fim[k] is None:
                fim[k] = next((vocab[t] for t in texts if t in vocab), None)
        stop = set(by_text.values()) | {i for i in (eos_id, eot_id, eom_id, *fim.values()) if i is not None}
        if "<|end|>" in by_text and (("<|return|>" in by_text and "<|call|>" in by_text)
                                     or ("<|calls|>" in by_text and "<|flush|>" in by_text)):
            stop.discard(by_text["<|end|>"])  # gpt-oss / solar-open: <|end|> ends a message, not the generation
            control.discard(by_text["<|end|>"])
        if "<|tool_response>" in by_text and "</s>" in by_text:
            stop.discard(by_text["</s>"])  # gemma4
        control |= stop  # llama.cpp forces end-of-generation tokens to control type

        # Control and user-defined tokens are matched whole in text (llama.cpp parses special tokens in prompts).
        user = [i for i, t in enumerate(types[:n]) if t == TOKEN_USER_DEFINED and i not in control]
        if control:
            tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in sorted(control)])
        if user:
            tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user])

        return cls(tok, vocab_size=n, bos_id=bos_id, eos_id=eos_id, stop_ids=stop, add_bos=add_bos,
                   add_eos=add_eos, chat_template=_field(fields, "tokenizer.chat_template") or None,
                   pre_tokenizer=pre_name)

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "Tokenizer":
        """From a Hugging Face model directory: tokenizer.json (+ tokenizer_config.json, generation_config.json,
        chat_template.jinja / chat_template.json when present)."""
        with untrusted(f"the tokenizer files in {path}"):
            return cls._from_hf_dir(path)

    @classmethod
    def _from_hf_dir(cls, path: str | Path) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        if path.is_file() and path.name == "tokenizer.json":
            path = path.parent
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise ModelFileError(
                f"{tj}: file is missing. sluice needs the Hugging Face fast-tokenizer file tokenizer.json in the model "
                "directory: download it from the model's repository (e.g. `huggingface-cli download <repo> "
                f"tokenizer.json --local-dir {path}`), or create it with transformers "
                "(`AutoTokenizer.from_pretrained(...).save_pretrained(dir)`).")
        try:
            text = tj.read_text(encoding="utf-8")
            spec = json.loads(text)
            tok = HFTokenizer.from_str(text)
        except BaseException as e:
            if not (isinstance(e, Exception) or is_rust_panic(e)):
                raise
            raise ModelFileError(f"{tj}: cannot read the tokenizer ({type(e).__name__}: {e}); the file is "
                                 "truncated or corrupt. Download it again.") from e

        cfg = _read_json(path / "tokenizer_config.json")
        gen = _read_json(path / "generation_config.json")

        def token_text(v) -> str | None:
            if isinstance(v, dict):
                v = v.get("content")
            return v if isinstance(v, str) else None

        bos_text, eos_text = token_text(cfg.get("bos_token")), token_text(cfg.get("eos_token"))
        lead, trail = _post_processor_specials(spec.get("post_processor"))
        if bos_text is None and lead:
            bos_text = lead[0]
        bos_id = tok.token_to_id(bos_text) if bos_text is not None else None
        if bos_id is None and isinstance(gen.get("bos_token_id"), int):
            bos_id = gen["bos_token_id"]
        eos_id = tok.token_to_id(eos_text) if eos_text is not None else None
        gen_eos = gen.get("eos_token_id")
        gen_eos = [gen_eos] if isinstance(gen_eos, int) else [i for i in (gen_eos or []) if isinstance(i, int)]
        if eos_id is None and gen_eos:
            eos_id = gen_eos[0]

        add_bos = cfg.get("add_bos_token")
        if add_bos is None:  # no explicit flag: BOS is added iff tokenizer.json's post-processor adds it
            add_bos = bos_text is not None and bos_text in lead
        add_eos = cfg.get("add_eos_token")
        if add_eos is None:
            add_eos = eos_text is not None and eos_text in trail

        vocab_size = tok.get_vocab_size(with_added_tokens=True)
        vocab = tok.get_vocab(with_added_tokens=True)
        vocab_size = max(vocab_size, max(vocab.values(), default=-1) + 1)
        stop = {vocab[t] for t in EOG_TEXTS if t in vocab} | set(gen_eos)
        if eos_id is not None:
            stop.add(eos_id)

        return cls(tok, vocab_size=vocab_size, bos_id=bos_id, eos_id=eos_id, stop_ids=stop,
                   add_bos=bool(add_bos) and bos_id is not None, add_eos=bool(add_eos) and eos_id is not None,
                   chat_template=_hf_chat_template(path, cfg), bos_token=bos_text, eos_token=eos_text)

    # ------------------------------------------------------------------ encode / decode
    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of `text`. With `add_special`, BOS/EOS are added as the model specifies. Runs without holding
        Python's GIL, so a long text does not stall the caller's other threads (a server's event loop)."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, not {type(text).__name__}")
        check_text(text, "the text")
        hf = self._tok if parse_special else self._plain()
        ids = hf.encode_batch([text], add_special_tokens=False)[0].ids  # encode() would hold the GIL throughout
        if add_special:
            if self.add_bos:
                ids = [self.bos_id, *ids]
            if self.add_eos:
                ids.append(self.eos_id)
        return ids

    def _plain(self):
        """A copy of the HF tokenizer that reads special-token texts as plain text (its own object: the setting
        cannot change under another thread's encode)."""
        with self._lock:
            if self._plain_tok is None:
                from tokenizers import Tokenizer as HFTokenizer

                plain = HFTokenizer.from_str(self._tok.to_str())
                plain.encode_special_tokens = True
                self._plain_tok = plain
        return self._plain_tok

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of `ids`. `skip_special` drops control tokens (BOS, <|im_end|>, ...)."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def token_to_id(self, text: str) -> int | None:
        return self._tok.token_to_id(text)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of `token_id` (byte-level encoded for BPE vocabularies, e.g. 'Ġthe')."""
        return self._tok.id_to_token(int(token_id))

    def stream_decoder(self, skip_special: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special=skip_special)

    # ------------------------------------------------------------------ chat
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) with the model's chat template.

        The template runs in a sandboxed Jinja environment the way transformers runs it (trim_blocks,
        lstrip_blocks, `raise_exception`, `tojson`, `strftime_now`, loop controls; variables `messages`,
        `add_generation_prompt`, `bos_token`, `eos_token` and any `kwargs`, e.g. `tools`). A model without a
        template gets `CHATML_TEMPLATE` (plain ChatML, no default system prompt), which may not be the format
        the model was trained on.
        """
        import jinja2

        template = self._compiled_template()
        try:
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)
        except _TemplateRaised as e:
            raise SluiceError(f"The model's chat template rejected the conversation: {e}") from None
        except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError, RecursionError) as e:
            raise InvalidOptionError(f"The model's chat template failed on this conversation ({type(e).__name__}: "
                                     f"{e}); check the messages and the template arguments.") from None
        except jinja2.TemplateError as e:
            raise ModelFileError(f"The model's chat template failed ({type(e).__name__}: {e}). Pass a raw prompt "
                                 "instead of chat messages.") from e

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, special_in_text: bool = False,
                    **kwargs) -> tuple[str, list[int]]:
        """The chat template's text and its token ids (no BOS/EOS added: templates write their own). Unless
        `special_in_text`, a special token's text inside the messages or kwargs (a user writing `<|im_start|>system`)
        is tokenized as plain text: only the template's own become special tokens. Each such text is swapped for an
        unguessable marker before rendering, and the marked pieces are encoded as plain text after it."""
        pattern = None if special_in_text else self._special_pattern()
        if pattern is None:
            text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
            return text, self.encode(text, add_special=False)
        found: list[str] = []
        mark = f"\ue000{secrets.token_hex(8)}\ue001"

        def swap(match):
            found.append(match.group())
            return f"{mark}{len(found) - 1}{mark}"

        def hide(value):
            if isinstance(value, str):
                return pattern.sub(swap, value)
            if isinstance(value, dict):
                return {k: hide(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return [hide(v) for v in value]
            return value

        marked = self.apply_chat_template(hide(messages), add_generation_prompt, **hide(kwargs))
        parts = re.split(f"{mark}([0-9]+){mark}", marked)  # template text, a hidden index, template text, ...
        ids, texts = [], []
        for i, part in enumerate(parts):
            if i % 2:
                part = found[int(part)]
                ids += self.encode(part, add_special=False, parse_special=False)
            elif part:
                ids += self.encode(part, add_special=False)
            texts.append(part)
        return "".join(texts), ids

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token stands for (the longest vocabulary entry: byte-level BPE entries hold one
        character per byte, and a character is at least one byte): a text longer than n times this cannot be n
        tokens or fewer."""
        return max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)

    def _special_pattern(self):
        """A regex of the special tokens' texts (longest first), or None when the vocabulary has none."""
        if self._specials is None:
            added = self._tok.get_added_tokens_decoder().values()
            texts = sorted({t.content for t in added if t.special and t.content}, key=len, reverse=True)
            self._specials = re.compile("|".join(map(re.escape, texts))) if texts else False
        return self._specials or None

    def _compiled_template(self):
        if self._template is None:
            import jinja2

            env = _jinja_env()
            try:
                self._template = env.from_string(self.chat_template or CHATML_TEMPLATE)
            except jinja2.TemplateSyntaxError as e:
                raise ModelFileError(f"The model's chat template is not valid Jinja ({e}). Pass a raw prompt "
                                     "instead of chat messages.") from e
        return self._template


CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class _TemplateRaised(Exception):
    pass


def _raise_exception(message):
    raise _TemplateRaised(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _jinja_env():
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _read_json(p: Path) -> dict:
    if not p.is_file():
        return {}
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelFileError(f"{p}: not valid JSON ({e}). Download it again.") from e
    return data if isinstance(data, dict) else {}


def _hf_chat_template(path: Path, cfg: dict) -> str | None:
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    tpl = _read_json(path / "chat_template.json").get("chat_template") or cfg.get("chat_template")
    if isinstance(tpl, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default") or next(iter(named.values()), None)
    return tpl if isinstance(tpl, str) and tpl else None


def _post_processor_specials(pp) -> tuple[list[str], list[str]]:
    """Special tokens a tokenizer.json post-processor puts before / after a single sequence."""
    if not isinstance(pp, dict):
        return [], []
    if pp.get("type") == "Sequence":
        lead: list[str] = []
        trail: list[str] = []
        for p in pp.get("processors") or []:
            a, b = _post_processor_specials(p)
            lead, trail = lead + a, trail + b
        return lead, trail
    if pp.get("type") == "TemplateProcessing":
        lead, trail, seen_seq = [], [], False
        for item in pp.get("single") or []:
            if "Sequence" in item:
                seen_seq = True
            elif "SpecialToken" in item:
                (trail if seen_seq else lead).append(item["SpecialToken"].get("id"))
        return lead, trail
    if pp.get("type") in ("RobertaProcessing", "BertProcessing"):
        return [pp.get("cls", [None])[0]], [pp.get("sep", [None])[0]]
    return [], []


class StreamDecoder:
    """Incremental detokenizer: `push(id)` returns the text that became final, `flush()` the rest.

    A byte-level BPE token can hold part of a UTF-8 character (an emoji split over tokens), so the text
    decoded so far may end in U+FFFD: that last replacement character is held back until the bytes after it
    arrive. (Only the last one can change: an incomplete UTF-8 sequence decodes to exactly one U+FFFD.) The
    decode window is kept short, so each push costs O(1) whatever the length of the generation; the
    concatenated output equals `tokenizer.decode(all_ids)`.
    """

    _WINDOW = 64  # tokens decoded per push at most (before the window slides)
    _KEEP = 4     # tokens kept when sliding: a UTF-8 character spans at most 4 byte-level tokens

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._tok = tokenizer
        self._skip = skip_special
        self._ids: list[int] = []
        self._emitted = 0  # characters of decode(self._ids) already returned

    def _stable_len(self, text: str) -> int:
        return len(text) - 1 if text.endswith(REPLACEMENT_CHAR) else len(text)

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        text = self._tok.decode(self._ids, skip_special=self._skip)
        stable = self._stable_len(text)
        out = text[self._emitted:stable] if stable > self._emitted else ""
        self._emitted = max(self._emitted, stable)
        if len(self._ids) > self._WINDOW:
            self._ids = self._ids[-self._KEEP:]
            self._emitted = self._stable_len(self._tok.decode(self._ids, skip_special=self._skip))
        return out

    def flush(self) -> str:
        """The held-back tail (a U+FFFD if the generation ended inside a UTF-8 character); resets the decoder."""
        text = self._tok.decode(self._ids, skip_special=self._skip) if self._ids else ""
        out = text[self._emitted:]
        self._ids, self._emitted = [], 0
        return out
