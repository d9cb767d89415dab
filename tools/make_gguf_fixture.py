"""Regenerate the Qwen3.5 GGUF test fixtures (tests/fixtures/README.md) with llama.cpp's own converter.

    pip download llama-cpp-python==0.3.36 --no-deps --no-binary :all: -d /tmp/lcp
    tar xzf /tmp/lcp/llama_cpp_python-0.3.36.tar.gz -C /tmp/lcp
    .venv/bin/python tools/make_gguf_fixture.py /tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp

Each fixture's source is an HF folder that kiln's synth draws (`write_source`; the tests draw it again
and compare), plus a tiny byte-level BPE tokenizer, because the converter wants one. The converter
names a BPE tokenizer's pre-tokenizer by hashing how it splits a fixed text, and knows only the hashes
of published tokenizers, so the tiny one is named `qwen35` (what a real Qwen3.5 tokenizer hashes to)
by replacing that one method; the tensors and every other key are the converter's own.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kiln.models import model_config  # noqa: E402
from kiln.weights.synth import CONFIGS, Synthesis, synth_config, write_checkpoint  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures"
# fixture file -> (synth spec, layers, changes to its config, seed). Fewer layers, experts and tokens
# than the spec keep the f32 file under 2 MB; still two GDN layers and a full-attention one.
SOURCES = {
    "tiny-qwen3.5-moe.gguf": ("tiny-qwen3.5-moe", 3, {"num_experts": 8, "vocab_size": 384}, 5),
    "tiny-qwen3.5.gguf": ("tiny-qwen3.5", 2, {"vocab_size": 384, "intermediate_size": 120}, 5),
}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen3.5's own split regex, so that the tiny tokenizer splits text as the name `qwen35` says
QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CORPUS = ["The quick brown fox jumps over the lazy dog.", "Hello world, hello kiln!",
          "A tiny tokenizer for a tiny model: 0 1 2 3 4 5 6 7 8 9.", "What is the capital of France? Paris."]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}" \
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"


def source_config(fixture: str) -> dict:
    spec, layers, changes, _ = SOURCES[fixture]
    assert spec in CONFIGS
    return dict(synth_config(spec, layers), **changes)


def write_source(fixture: str, out: Path) -> Path:
    """The fixture's HF source folder (bf16 safetensors and config.json, no tokenizer) at `out`."""
    config, seed = source_config(fixture), SOURCES[fixture][3]
    cls, cfg = model_config(config)
    drawn = Synthesis(config, cls.checkpoint_shapes(cfg), cls.norm_style == "offset", seed=seed)
    return write_checkpoint(drawn, out, SOURCES[fixture][0], dtype="bf16", quiet=True)


def write_tokenizer(out: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer trained on a few sentences (fewer tokens than the model's vocabulary:
    the converter pads the rest), its specials and a ChatML template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(vocab_size, 320), special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "add_bos_token": False, "chat_template": TEMPLATE, "model_max_length": 1024}, indent=1))


_CONVERT = """
import runpy, sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(1, sys.argv[1] + "/gguf-py")
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen35"
script = sys.argv[1] + "/convert_hf_to_gguf.py"
sys.argv = [script, *sys.argv[2:]]
runpy.run_path(script, run_name="__main__")
"""


def convert(llama_cpp: Path, src: Path, outfile: Path) -> None:
    """llama.cpp's convert_hf_to_gguf.py on `src`, f32, in a process of its own (it puts its own gguf
    package first on sys.path)."""
    # --no-mtp: the source has no multi-token-prediction head (the converter expects one otherwise)
    cmd = [sys.executable, "-c", _CONVERT, str(llama_cpp), str(src), "--outtype", "f32", "--no-mtp",
           "--outfile", str(outfile)]
    subprocess.run(cmd, check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("llama_cpp", type=Path, help="vendor/llama.cpp of the llama-cpp-python 0.3.36 sdist")
    ap.add_argument("--out", type=Path, default=FIXTURES)
    ap.add_argument("--only", choices=sorted(SOURCES), help="one fixture (default: all)")
    args = ap.parse_args()
    for fixture in [args.only] if args.only else SOURCES:
        with tempfile.TemporaryDirectory() as tmp:
            # the folder's name becomes the file's general.name
            src = write_source(fixture, Path(tmp) / fixture.removesuffix(".gguf"))
            write_tokenizer(src, source_config(fixture)["vocab_size"])
            convert(args.llama_cpp, src, args.out / fixture)
        print(f"{args.out / fixture}: {(args.out / fixture).stat().st_size} bytes")


if __name__ == "__main__":
    main()
