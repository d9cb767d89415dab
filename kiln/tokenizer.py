"""Text <-> token ids, chat templates and streaming detokenisation.

`Tokenizer` wraps a `tokenizers.Tokenizer` (the Rust one). From a GGUF file we rebuild, from the
metadata alone, the same tokenizer transformers builds for `AutoTokenizer.from_pretrained(dir,
gguf_file=...)`, so that ids match it exactly; transformers itself is never imported here.

What transformers builds, per `tokenizer.ggml.model`:
  gpt2   byte-level BPE: ByteLevel pre-tokenizer/decoder, merges from the file, and tokens spelled
         outside the byte alphabet re-spelled into it.
  llama  SentencePiece-style BPE with byte fallback: Metaspace("first") pre-tokenizer and a decoder
         that strips the one leading space. Gemma 1-3 files instead get Gemma's shape (spaces become
         "\u2581" in a normalizer, no prefix space) and phi3 a Prepend+Replace normalizer. Files without
         merges get them rebuilt from the vocabulary.
  gemma4 Gemma's shape, merges rebuilt from the scores, never a BOS.
Then tokens typed "control" (3) become special added tokens, "user-defined" (4) plain added ones,
some `tokenizer.ggml.pre` names swap in a split regex, and BOS/EOS are added by a post-processor.
"""

from __future__ import annotations

import json
import os
import tempfile
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend

from .errors import KilnError
from .fsutil import cache_dir

# The names transformers hands a chat template (its SPECIAL_TOKENS_ATTRIBUTES), in its order.
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_GGUF_SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                     "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}
_CONTROL, _USER_DEFINED = 3, 4   # llama.cpp token types
_SPM_SPACE = "\u2581"

# Split regexes transformers substitutes for some `tokenizer.ggml.pre` names (patterns, i.e. data).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}
_GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")


# ---------------------------------------------------------------------------------------------
# The Tokenizer


class Tokenizer:
    """A `tokenizers.Tokenizer` plus what the model files say around it (BOS/EOS, chat template)."""

    def __init__(self, backend: _Backend, *, bos_id: int | None, eos_ids: list[int],
                 special_tokens: dict[str, str | None], chat_template: str | dict | None,
                 vocab_size: int | None = None):
        self.backend = backend
        self.bos_id = bos_id
        self.eos_ids = list(dict.fromkeys(i for i in eos_ids if i is not None))
        self.eos_id = self.eos_ids[0] if self.eos_ids else None
        # Only the named tokens that are set, as strings: this is what templates see.
        self.special_tokens = {k: v for k, v in special_tokens.items() if v is not None}
        self._templates = chat_template if isinstance(chat_template, dict) else (
            {"default": chat_template} if chat_template else {})
        self.vocab_size = vocab_size or backend.get_vocab_size(with_added_tokens=True)
        # Whether encode() puts BOS first: ask the post-processor rather than trusting a flag.
        probe = backend.encode("", add_special_tokens=True).ids
        self.add_bos = bos_id is not None and probe[:1] == [bos_id]
        self._byte_ids = _byte_fallback_ids(backend)
        self._raw_byte_ids = _raw_byte_ids(backend)

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, metadata: dict, cache_key: str | None = None) -> "Tokenizer":
        """Build from GGUF metadata (as GGUFFile(path).metadata gives it).

        Gemma's 262k vocabulary has no merges in the file and takes ~2 s to rebuild; with
        `cache_key` (a hash of the file's identity) the built tokenizer is kept as JSON in the kiln
        cache and later loads take ~1 s. A corrupt cache file is ignored and rewritten.
        """
        backend = _cache_load(cache_key)
        if backend is None:
            backend = _gguf_backend(metadata)
            _cache_store(cache_key, backend)
        return cls(backend, **_gguf_extras(metadata, backend))

    @classmethod
    def from_hf_dir(cls, path) -> "Tokenizer":
        """Build from a Hugging Face tokenizer directory (tokenizer.json is taken as it is)."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise KilnError(f"{path} has no tokenizer.json; kiln needs the fast-tokenizer file")
        try:
            backend = _Backend.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # the Rust side raises plain Exception on a bad file
            raise KilnError(f"cannot read {path / 'tokenizer.json'}: {e}") from None
        config = _read_json(path / "tokenizer_config.json")
        legacy_map = _read_json(path / "special_tokens_map.json")
        specials = {n: _token_text(config.get(n, legacy_map.get(n))) for n in _SPECIAL_NAMES}
        generation = _read_json(path / "generation_config.json")
        eos_ids = [backend.token_to_id(specials["eos_token"]) if specials["eos_token"] else None]
        extra_eos = generation.get("eos_token_id")
        eos_ids += extra_eos if isinstance(extra_eos, list) else [extra_eos]
        bos = specials["bos_token"]
        return cls(backend, bos_id=backend.token_to_id(bos) if bos else None, eos_ids=eos_ids,
                   special_tokens=specials, chat_template=_hf_chat_template(path, config))

    # -- ids <-> text ---------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self.backend.id_to_token(int(i))

    def token_to_id(self, s: str) -> int | None:
        return self.backend.token_to_id(s)

    def is_byte_token(self, i: int) -> bool:
        """True for a byte-fallback token like <0xE6>, whose text depends on its neighbours."""
        return i in self._byte_ids

    def raw_byte_id(self, b: int) -> int | None:
        """The id of a token that decodes to the one raw byte `b` (<0xNN> with byte fallback, the byte
        alphabet's character in byte-level BPE), or None where the vocabulary has no such token."""
        return self._raw_byte_ids.get(b)

    # -- chat -----------------------------------------------------------------------------
    @property
    def templates(self) -> Mapping[str, str]:
        """The chat templates by name, read-only: "default", and any the model ships beside it
        (e.g. "tool_use", which apply_chat_template takes when it is given tools)."""
        return MappingProxyType(self._templates)

    @property
    def chat_template(self) -> str | None:
        return self._templates.get("default")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list | None = None, **extra) -> str:
        """The prompt text for `messages`, rendered as transformers renders it (tokenize=False)."""
        source = self._templates.get("tool_use") if tools is not None else None
        source = source or self._templates.get("default")
        if source is None:
            raise KilnError("this model has no chat template; use `kiln run` for raw completion")
        template = _compile_template(source)
        messages = _plain_messages(messages)
        variables = {**self.special_tokens, "documents": None, **extra}
        try:
            return template.render(messages=messages, tools=tools,
                                   add_generation_prompt=add_generation_prompt, **variables)
        except Exception as e:  # raise_exception(), undefined names, type errors inside the template
            raise KilnError(f"chat template error: {_one_line(e)}") from None


# ---------------------------------------------------------------------------------------------
# GGUF -> tokenizers.Tokenizer


def _gguf_backend(md: dict) -> _Backend:
    kind, arch = md.get("tokenizer.ggml.model"), md.get("general.architecture")
    if "tokenizer.ggml.tokens" not in md:
        raise KilnError("this GGUF file has no tokenizer (no tokenizer.ggml.tokens)")
    tokens = list(md["tokenizer.ggml.tokens"])
    if kind == "gpt2":
        backend = _byte_level(md, tokens)
    elif kind == "llama" and arch in _GEMMA_ARCHS:
        backend = _gemma(md, tokens, respell=True)
    elif kind == "gemma4":
        backend = _gemma(md, tokens, respell=False)
    elif kind == "llama":
        backend = _sentencepiece(md, tokens, phi3=arch == "phi3")
    else:
        raise KilnError(f"unsupported tokenizer type {kind!r} in this GGUF file (kiln reads gpt2, llama, gemma4)")
    _add_typed_tokens(backend, md, kind == "gpt2")
    split = _PRE_SPLITS.get(md.get("tokenizer.ggml.pre"))
    if split is not None:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    _set_post_processor(backend, md)
    return backend


def _gguf_extras(md: dict, backend: _Backend) -> dict:
    """The Tokenizer fields that come from the metadata rather than the backend."""
    tokens = md["tokenizer.ggml.tokens"]
    specials = {name: _nth(tokens, md.get(f"tokenizer.ggml.{key}")) for name, key in _GGUF_SPECIAL_IDS.items()}
    if _is_gemma_class(md) and backend.token_to_id("<mask>") is not None:
        specials["mask_token"] = "<mask>"   # GemmaTokenizer's own default, which the file cannot override
    eos_ids = [md.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    templates = {"default": md.get("tokenizer.chat_template")}
    for key, value in md.items():   # llama.cpp stores extra named templates as tokenizer.chat_template.<name>
        if key.startswith("tokenizer.chat_template."):
            templates[key.removeprefix("tokenizer.chat_template.")] = value
    return dict(bos_id=md.get("tokenizer.ggml.bos_token_id"), eos_ids=eos_ids, special_tokens=specials,
                chat_template={k: v for k, v in templates.items() if v} or None, vocab_size=len(tokens))


def _byte_level(md: dict, tokens: list[str]) -> _Backend:
    """GPT-2 style: every vocabulary entry is spelled in the 256-character byte alphabet."""
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {(t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
             for i, t in enumerate(tokens)}
    backend = _Backend(models.BPE(vocab=vocab, merges=_file_merges(md), dropout=None, continuing_subword_prefix="",
                                  end_of_word_suffix="", fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    _add_defaults(backend, ["<|endoftext|>"])   # GPT2Tokenizer's default unk/bos/eos
    return backend


def _gemma(md: dict, tokens: list[str], respell: bool) -> _Backend:
    """Gemma: spaces turned into U+2581 by a normalizer, byte fallback, merges rebuilt."""
    if respell:
        # Gemma 1-3 files store the multi-space tokens as real spaces; the normalizer never emits
        # those, so transformers renames them to U+2581 runs (same test as it uses: blank with a space).
        tokens = [_SPM_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    if respell:   # these files' scores do not follow merge order; the file order does
        ranks = {t: -i for i, t in enumerate(tokens)}
    else:
        ranks = dict(zip(tokens, md.get("tokenizer.ggml.scores") or []))
    merges = _file_merges(md) or _merges_from_vocab(vocab, ranks)
    backend = _Backend(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, unk_token="<unk>",
                                  dropout=None, byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", _SPM_SPACE)
    backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    backend.decoder = decoders.Sequence([decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(),
                                         decoders.Fuse()])
    _add_defaults(backend, ["<bos>", "<eos>", "<unk>", "<pad>", "<mask>"])
    return backend


def _sentencepiece(md: dict, tokens: list[str], phi3: bool) -> _Backend:
    """LlamaTokenizer's shape: Metaspace prefix on the first word only, byte fallback."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = _file_merges(md) or _merges_from_vocab(vocab, dict(zip(tokens, md.get("tokenizer.ggml.scores") or [])))
    backend = _Backend(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
    if phi3:   # Phi-3 adds the prefix space in a normalizer, so "  hi" keeps all its spaces
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(_SPM_SPACE),
                                                   normalizers.Replace(" ", _SPM_SPACE)])
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPM_SPACE, prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(content=" ", left=1, right=0)])
    _add_defaults(backend, ["<s>", "</s>", "<unk>"])   # LlamaTokenizer's defaults
    return backend


def _file_merges(md: dict) -> list[tuple[str, str]]:
    return [tuple(m.split(" ")) for m in md.get("tokenizer.ggml.merges") or []]


def _merges_from_vocab(vocab: dict[str, int], ranks: dict[str, float]) -> list[tuple[str, str]]:
    """Every way to cut a token into two vocabulary tokens, best-ranked token first.

    The order is transformers' `generate_merges` order: rank descending, then longer left piece
    first (then longer right piece, then first-seen). Gemma's ranks are all distinct and already
    descending, so the list comes out sorted and the sort (the slow part) is skipped.
    """
    found = []
    for token, rank in ranks.items():
        for cut in range(len(token) - 1, 0, -1):   # longest left piece first
            left = token[:cut]
            if left in vocab:
                right = token[cut:]
                if right in vocab:
                    found.append((rank, left, right))
    scores = list(ranks.values())
    if any(a <= b for a, b in zip(scores, scores[1:])):
        found.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)   # stable, like transformers
    return [(left, right) for _, left, right in found]


def _add_defaults(backend: _Backend, names: list[str]) -> None:
    """The special tokens transformers' tokenizer class registers before the file's own ones.

    transformers also *appends* a default that the vocabulary lacks (an id the model has no row
    for); we only mark the ones that exist.
    """
    present = [n for n in names if backend.token_to_id(n) is not None]
    backend.add_special_tokens([AddedToken(n, normalized=False, special=True) for n in present])


def _add_typed_tokens(backend: _Backend, md: dict, byte_level: bool) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens.

    Added tokens are matched whole in the text before the model sees it, as llama.cpp does. In a
    byte-level vocabulary a control token spelled outside the byte alphabet is a mislabel, skipped.
    """
    tokens, types = md["tokenizer.ggml.tokens"], md.get("tokenizer.ggml.token_type") or []
    alphabet = set(_bytes_to_unicode().values()) if byte_level else None
    control = [t for t, k in zip(tokens, types) if k == _CONTROL and (alphabet is None or set(t) <= alphabet)]
    if control:
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    user = [t for t, k in zip(tokens, types) if k == _USER_DEFINED and backend.token_to_id(t) is not None]
    if user:
        backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])


def _set_post_processor(backend: _Backend, md: dict) -> None:
    """BOS/EOS insertion, with transformers' defaults: BOS on for SentencePiece, off for gemma4/gpt2."""
    kind = md.get("tokenizer.ggml.model")
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", kind == "llama")) and kind != "gemma4"
    add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False))
    bos, eos = (_nth(md["tokenizer.ggml.tokens"], md.get(f"tokenizer.ggml.{k}_token_id")) for k in ("bos", "eos"))
    add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
    head = [f"{bos}:0"] if add_bos else []
    tail = [f"{eos}:0"] if add_eos else []
    second = ([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else [])
    used = [(t, backend.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
    backend.post_processor = processors.TemplateProcessing(
        single=" ".join(head + ["$A:0"] + tail), pair=" ".join(head + ["$A:0"] + tail + second),
        special_tokens=used)


def _is_gemma_class(md: dict) -> bool:
    """Whether transformers' outer class is GemmaTokenizer (gemma4 files get the generic one)."""
    return md.get("tokenizer.ggml.model") == "llama" and md.get("general.architecture") in _GEMMA_ARCHS


def _nth(tokens, i):
    return tokens[i] if i is not None and 0 <= i < len(tokens) else None


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table: printable Latin-1 bytes map to themselves, the
    rest to code points from 256 up, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _byte_fallback_ids(backend: _Backend) -> frozenset[int]:
    """Ids of <0xNN> tokens, when the decoder turns them into raw bytes (ByteFallback)."""
    state = backend.decoder.__getstate__() if backend.decoder is not None else b""
    if b'"ByteFallback"' not in state:
        return frozenset()
    ids = (backend.token_to_id(f"<0x{b:02X}>") for b in range(256))
    return frozenset(i for i in ids if i is not None)


def _raw_byte_ids(backend: _Backend) -> dict[int, int]:
    """byte -> the id of the token that decodes to that one byte, in whichever spelling this decoder
    reads as bytes (<0xNN>, or GPT-2's byte alphabet; a vocabulary may lack a few); {} when neither."""
    for spell in (lambda b: f"<0x{b:02X}>", _bytes_to_unicode().get):
        ids = {b: backend.token_to_id(spell(b)) for b in range(256)}
        ids = {b: i for b, i in ids.items() if i is not None}
        if 0xC3 in ids and 0xA9 in ids and backend.decode([ids[0xC3], ids[0xA9]]) == "é":
            return ids
    return {}


# ---------------------------------------------------------------------------------------------
# Cache (optional: see Tokenizer.from_gguf)


BUILD_VERSION = 1  # bump whenever the GGUF tokenizer build changes: it names the cached builds


def _cache_path(cache_key: str) -> Path:
    return cache_dir() / "tokenizers" / f"{cache_key}-v{BUILD_VERSION}.json"


def _cache_load(cache_key: str | None) -> _Backend | None:
    if not cache_key:
        return None
    try:
        return _Backend.from_file(str(_cache_path(cache_key)))
    except Exception:   # missing or corrupt: rebuild it
        return None


def _cache_store(cache_key: str | None, backend: _Backend) -> None:
    if not cache_key:
        return
    path = _cache_path(cache_key)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(backend.to_str())
        os.replace(tmp, path)   # readers see the old file or the whole new one, never half
    except OSError:   # a cache we cannot write only costs time
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


# ---------------------------------------------------------------------------------------------
# Hugging Face directory helpers


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise KilnError(f"cannot read {path}: {e}") from None
    return data if isinstance(data, dict) else {}


def _token_text(value) -> str | None:
    """A special token as tokenizer_config writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _hf_chat_template(path: Path, config: dict) -> dict | None:
    """Template files win over the config entry, as in transformers."""
    templates = {}
    for extra in sorted((path / "additional_chat_templates").glob("*.jinja")):
        templates[extra.stem] = extra.read_text(encoding="utf-8")
    if (path / "chat_template.jinja").is_file():
        templates["default"] = (path / "chat_template.jinja").read_text(encoding="utf-8")
    if templates:
        return templates
    entry = config.get("chat_template") or _read_json(path / "chat_template.json").get("chat_template")
    if isinstance(entry, list):   # legacy list of {name, template}
        return {t["name"]: t["template"] for t in entry if isinstance(t, dict) and "name" in t} or None
    return {"default": entry} if isinstance(entry, str) else None


# ---------------------------------------------------------------------------------------------
# Chat templates


@lru_cache(maxsize=16)
def _compile_template(source: str):
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; here it
        only has to parse and render its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise KilnError(f"malformed chat template (line {e.lineno}): {e.message}") from None


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes <, >, & and ' for HTML, which would change prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _plain_messages(messages: list[dict]) -> list[dict]:
    """Copies the template may not mutate; None-valued keys dropped and the reasoning field
    aliased, as transformers does (templates treat a missing key better than a None)."""
    out = []
    for message in messages:
        if not isinstance(message, dict):
            raise KilnError(f"chat messages must be dicts with 'role' and 'content', got {type(message).__name__}")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in ("reasoning_content", "thinking", "reasoning") if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split()) or type(e).__name__


# ---------------------------------------------------------------------------------------------
# Streaming detokenisation


# Bytes that complete any UTF-8 sequence cut short: after the lead byte, 0x80 or 0xA0 fits each
# lead's range for its second byte (E0: A0-BF, ED: 80-9F, F0: 90-BF, F4: 80-8F), 0x80 any later one.
_COMPLETIONS = ((0x80,), (0xA0,), (0x80, 0x80), (0xA0, 0x80), (0x80, 0x80, 0x80), (0xA0, 0x80, 0x80))


class StreamDecoder:
    """Turns generated ids into text pieces as they arrive.

    Each push decodes a small window (the last emitted token onwards) and returns what it adds to
    the text. Text is held back while it ends in U+FFFD (an incomplete UTF-8 sequence), and while the
    last token is a <0xNN> byte token: a run of those is decoded as one unit, so a byte that comes
    later can still change how the earlier ones read. At flush() a character still incomplete (the
    generation ended inside it) is held back for good rather than sent as U+FFFD. With
    `prompt_ids=None` the pieces plus flush() add up to `tokenizer.decode(generated ids)`, less that
    cut character; with prompt ids, the first piece keeps the leading space a SentencePiece decoder
    would strip at the start of a text.
    """

    _CONTEXT = 4   # prompt tokens kept for context; enough for the first piece's leading space

    def __init__(self, tokenizer: Tokenizer, prompt_ids=None, skip_special_tokens: bool = False):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids = [int(i) for i in prompt_ids][-self._CONTEXT:] if prompt_ids is not None else []
        self._start = 0                 # window start: decoding from here is consistent with what was sent
        self._sent = len(self._ids)     # ids before this have been turned into returned text

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        if self._tok.is_byte_token(int(token_id)):
            return ""
        return self._advance(final=False)

    def flush(self) -> str:
        """The text held back, at the end of a generation."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        before = self._tok.decode(self._ids[self._start:self._sent], self._skip)
        text = self._tok.decode(self._ids[self._start:], self._skip)
        if text.endswith("\ufffd"):
            if not final:
                return ""
            text = self._without_cut_character(text)
        self._start, self._sent = self._sent, len(self._ids)
        # Keep the list short; only ids from the window start on are ever decoded again.
        del self._ids[:self._start]
        self._sent -= self._start
        self._start = 0
        return text[len(before):]

    def _without_cut_character(self, text: str) -> str:
        """The window's `text` (ending in U+FFFD) less its last character when that is a UTF-8 sequence
        cut short, which some continuation bytes would complete. Otherwise the U+FFFD is the text (a
        byte no continuation makes valid, or a U+FFFD the model wrote) and stays."""
        for tail in _COMPLETIONS:
            ids = [self._tok.raw_byte_id(b) for b in tail]
            if None in ids:
                return text     # a vocabulary without byte tokens: nothing to tell them apart with
            completed = self._tok.decode(self._ids[self._start:] + ids, self._skip)
            if not completed.endswith("\ufffd"):
                return completed[:-1]   # the completed character is the last one: drop it
        return text
