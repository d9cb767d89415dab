"""Real weights: both bundled GGUF models against transformers on the same file (f32, CPU).

For 3 prompts per model (one code, one not English): kiln's prompt ids equal transformers'
tokenizer ids, and kiln's first 48 greedy tokens equal transformers' greedy `generate`.
"""

from __future__ import annotations

import pytest
import torch

import kiln
from kiln import hub

transformers = pytest.importorskip("transformers")

PROMPTS = {
    "smollm2-135m": [
        "The capital of France is",
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
        "La recette traditionnelle de la ratatouille comprend",
    ],
    "gemma3-270m": [
        "The history of the Roman Empire begins",
        "import numpy as np\n\ndef softmax(x):\n",
        "Die Hauptstadt von Deutschland ist",
    ],
}


@pytest.fixture(scope="module", params=list(PROMPTS))
def pair(request):
    name = request.param
    path = hub.ensure(name)
    ours = kiln.load(name, device="cpu", dtype="f32", backend="reference")   # the exact oracle
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                            dtype=torch.float32).eval()
    return name, ours, tok, ref


def test_prompt_ids_and_48_greedy_tokens_match_transformers(pair):
    name, ours, tok, ref = pair
    for prompt in PROMPTS[name]:
        ids = tok(prompt)["input_ids"]
        assert ours.tokenizer.encode(prompt) == ids, prompt
        with torch.no_grad():
            hf = ref.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False)[0, len(ids):].tolist()
        out = ours.generate(prompt, max_new_tokens=48)
        assert out.token_ids == hf, (prompt, out.text)
        assert out.stats.prompt_tokens == len(ids) and out.stats.generated_tokens == len(hf)


def test_sampling_is_seeded(pair):
    name, ours, _, _ = pair
    kw = dict(max_new_tokens=24, temperature=1.0, top_p=0.95, seed=7)
    a = ours.generate("Once upon a time", **kw)
    b = ours.generate("Once upon a time", **kw)
    c = ours.generate("Once upon a time", **{**kw, "seed": 8})
    assert a.text == b.text and a.token_ids == b.token_ids
    assert c.token_ids != a.token_ids


def test_stream_pieces_join_to_the_text(pair):
    name, ours, _, _ = pair
    prompt = "Les spécialités japonaises 日本料理 comme"
    pieces = list(ours.stream(prompt, max_new_tokens=24, temperature=0.9, seed=3))
    full = ours.generate(prompt, max_new_tokens=24, temperature=0.9, seed=3)
    assert "".join(pieces) == full.text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_ends_generation_and_is_excluded(pair):
    name, ours, _, _ = pair
    free = ours.generate("The capital of France is", max_new_tokens=30)
    words = free.text.split()
    assert len(words) >= 3, free.text
    stop = words[2]
    cut = ours.generate("The capital of France is", max_new_tokens=30, stop=[stop])
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.index(stop)]
