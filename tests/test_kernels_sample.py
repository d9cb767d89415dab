"""The device-side greedy choice (kiln.backends.cuda.sample.greedy_next) against torch.argmax on
fresh random logits of ragged vocabularies, with ties across programs, all -inf and NaN; and the
pipelined greedy loop (DecodeGraph.greedy_tokens) against the host's own argmax loop. Under Triton's
interpreter on CPU; the `gpu` test runs a 248,320 vocabulary (Qwen3.5's) on the device."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"   # before kiln's kernels are decorated

triton = pytest.importorskip("triton")

from kiln.backends.cuda import sample as S  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def run(logits: torch.Tensor) -> tuple[int, int]:
    ids = torch.full((1,), -1, dtype=torch.long, device=DEVICE)
    pos = torch.full((1,), 41, dtype=torch.long, device=DEVICE)
    S.greedy_next(logits, ids, pos)
    return int(ids), int(pos)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [1, 5, 2048, 2049, 6001, 20000])
def test_greedy_next_is_torch_argmax(vocab, dtype):
    g = torch.Generator().manual_seed(vocab)
    for _ in range(2):        # twice: the arrival counter resets itself
        logits = (torch.randn(vocab, generator=g) * 4).to(dtype=dtype, device=DEVICE)
        assert run(logits) == (int(torch.argmax(logits)), 42)


def test_greedy_next_ties_go_to_the_lowest_index():
    g = torch.Generator().manual_seed(1)
    for where in ([17, 19], [3000, 9], [19999, 10001, 14000], [4096, 2048]):
        logits = torch.randn(20000, generator=g).to(device=DEVICE, dtype=torch.bfloat16)
        logits[where] = 9.0
        assert run(logits)[0] == min(where) == int(torch.argmax(logits))


def test_greedy_next_all_minus_inf_and_nan():
    logits = torch.full((5000,), float("-inf"), device=DEVICE)
    assert run(logits)[0] == int(torch.argmax(logits)) == 0
    logits = torch.randn(5000, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    logits[[4000, 3999]] = float("nan")
    ids, pos = torch.zeros(1, dtype=torch.long, device=DEVICE), torch.zeros(1, dtype=torch.long, device=DEVICE)
    S.greedy_next_reference(logits, ids, pos)
    assert run(logits)[0] == int(ids) == 3999      # NaN as +inf: the first NaN


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_greedy_next_at_qwen35_vocabulary():
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        logits = (torch.randn(248320, generator=g) * 3).to(device=DEVICE, dtype=torch.bfloat16)
        assert run(logits) == (int(torch.argmax(logits)), 42)


def _runner_and_states(monkeypatch):
    import kiln
    from kiln import graphs

    llm = kiln.load("synth:tiny-llama", device="cpu", dtype="f32")
    runner = graphs.DecodeGraph(llm.model, torch.device("cpu"))
    monkeypatch.setattr(runner, "_capture", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no graphs")))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    return llm.engine, runner


def test_pipelined_greedy_tokens_equal_the_host_loop_and_count_what_was_fed(monkeypatch):
    """The device-fed loop (here the CPU runner: eager steps, reference argmax) gives the host loop's
    tokens; a consumer that stops after 3 tokens leaves two more steps run, and `fed` lists every
    token the state was fed, so the layers' lengths match it."""
    eng, runner = _runner_and_states(monkeypatch)
    ids = [5, 9, 77, 3]
    ours, plain = eng.new_state(32), eng.new_state(32)
    first = int(torch.argmax(eng.prefill(ids, ours)))
    assert first == int(torch.argmax(eng.prefill(ids, plain)))
    want, tok = [], first
    for k in range(8):
        tok = int(torch.argmax(eng.decode_step(tok, len(ids) + k, plain)))
        want.append(tok)
    fed: list[int] = []
    assert list(runner.greedy_tokens(first, len(ids), ours, 8, fed)) == want
    assert fed == [first] + want[:7] and ours[0].length == len(ids) + 8

    again = eng.new_state(32)
    eng.prefill(ids, again)
    fed = []
    stream = runner.greedy_tokens(first, len(ids), again, 8, fed)
    assert [next(stream) for _ in range(3)] == want[:3]
    stream.close()
    assert fed == [first] + want[:4] and again[0].length == len(ids) + len(fed)


def test_greedy_generate_gives_the_sampler_paths_tokens(monkeypatch):
    """generate() in greedy mode runs the pipelined loop: the same tokens as the sampler path (a
    repetition penalty of 1 + tiny epsilon is never exactly 1, so it takes the host loop)."""
    import kiln

    llm = kiln.load("synth:tiny-llama", device="cpu", dtype="f32")
    prompt = [5, 9, 77, 3, 41]
    fast = llm.generate(prompt, max_new_tokens=10, temperature=0).token_ids
    slow = llm.generate(prompt, max_new_tokens=10, temperature=0, repetition_penalty=1.0 + 1e-9).token_ids
    assert fast == slow and len(fast) == 10
