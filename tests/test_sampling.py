import random

import pytest
import torch

from kiln.errors import KilnError
from kiln.sampling import Sampler, SamplingParams, StopMatcher

# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def _random_logits(seed: int, vocab: int = 1000, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, generator=g) * scale


def _hf_scores(logits: torch.Tensor, processors, history: torch.Tensor | None = None) -> torch.Tensor:
    ids = (history if history is not None else torch.zeros(0, dtype=torch.long)).reshape(1, -1)
    scores = logits.float().reshape(1, -1).clone()
    for proc in processors:
        scores = proc(ids, scores)
    return scores[0]


# --------------------------------------------------------------------------------------------
# greedy and repetition penalty
# --------------------------------------------------------------------------------------------


def test_greedy_is_argmax():
    sampler = Sampler(SamplingParams(temperature=0.0))
    for seed in range(20):
        logits = _random_logits(seed, vocab=257)
        assert sampler(logits) == int(torch.argmax(logits))
    # first index on ties, as torch.argmax
    assert sampler(torch.tensor([1.0, 3.0, 3.0, 2.0])) == 1
    # low-precision input is accepted
    assert sampler(torch.tensor([0.5, -1.0, 4.0], dtype=torch.bfloat16)) == 2


def test_repetition_penalty_hand_example():
    logits = torch.tensor([2.0, -1.0, 0.5, -3.0, 1.5, 0.0])
    history = torch.tensor([0, 1, 1, 3, 3, 3, 5])  # repeats count once
    sampler = Sampler(SamplingParams(repetition_penalty=2.0))
    out = sampler.process(logits, history)
    expected = torch.tensor([1.0, -2.0, 0.5, -6.0, 1.5, 0.0])
    assert torch.equal(out, expected)
    # applied in greedy mode: token 0 (2.0 -> 1.0) loses to token 4 (1.5, unseen)
    assert sampler(logits, history) == 4
    assert Sampler(SamplingParams())(logits, history) == 0
    # a penalty < 1 rewards seen tokens: -3.0 * 0.1 = -0.3, 0.5 unseen
    out = Sampler(SamplingParams(repetition_penalty=0.1)).process(logits, history)
    assert out[3].item() == pytest.approx(-0.3)
    assert out[0].item() == pytest.approx(20.0)
    # no history => untouched
    assert torch.equal(sampler.process(logits, None), logits)


def test_repetition_penalty_matches_transformers():
    gen_utils = pytest.importorskip("transformers.generation.logits_process")
    for seed, penalty in [(0, 1.3), (1, 0.7), (2, 2.5)]:
        logits = _random_logits(seed, vocab=500)
        g = torch.Generator().manual_seed(100 + seed)
        history = torch.randint(0, 500, (200,), generator=g)
        ours = Sampler(SamplingParams(repetition_penalty=penalty)).process(logits, history)
        theirs = _hf_scores(logits, [gen_utils.RepetitionPenaltyLogitsProcessor(penalty)], history)
        assert not torch.equal(ours, logits)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# filters: compare the set of samplable tokens with transformers' warpers
# --------------------------------------------------------------------------------------------

FILTER_CASES = [
    # (temperature, top_k, top_p, min_p)
    (1.0, 1, 1.0, 0.0),
    (1.0, 5, 1.0, 0.0),
    (0.7, 50, 1.0, 0.0),
    (1.0, 0, 0.5, 0.0),
    (1.0, 0, 0.9, 0.0),
    (1.3, 0, 0.95, 0.0),
    (1.0, 0, 1.0, 0.05),
    (0.8, 0, 1.0, 0.2),
    (1.0, 0, 1.0, 1.0),
    (0.9, 40, 0.9, 0.0),
    (1.1, 100, 0.8, 0.1),
    (0.6, 0, 0.97, 0.02),
]


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", FILTER_CASES)
def test_filters_match_transformers(temperature, top_k, top_p, min_p):
    lp = pytest.importorskip("transformers.generation.logits_process")
    procs = [lp.TemperatureLogitsWarper(temperature)]
    if top_k:
        procs.append(lp.TopKLogitsWarper(top_k))
    if top_p < 1.0:
        procs.append(lp.TopPLogitsWarper(top_p))
    if min_p > 0.0:
        procs.append(lp.MinPLogitsWarper(min_p))
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    sampler = Sampler(params, device="cpu")
    for seed in range(10):
        logits = _random_logits(seed)
        ours = torch.isfinite(sampler.process(logits))
        theirs = torch.isfinite(_hf_scores(logits, procs))
        assert torch.equal(ours, theirs), (seed, int(ours.sum()), int(theirs.sum()))
        # the filter did something (except the degenerate settings that keep everything)
        assert int(ours.sum()) < logits.numel()
        # and every draw lands in the kept set
        for _ in range(20):
            assert ours[sampler(logits)]


def test_filters_combined_with_repetition_penalty_match_transformers():
    lp = pytest.importorskip("transformers.generation.logits_process")
    logits = _random_logits(7)
    history = torch.topk(logits, 30).indices  # penalise the current favourites
    procs = [
        lp.RepetitionPenaltyLogitsProcessor(3.0),
        lp.TemperatureLogitsWarper(0.9),
        lp.TopKLogitsWarper(60),
        lp.TopPLogitsWarper(0.9),
        lp.MinPLogitsWarper(0.05),
    ]
    params = SamplingParams(temperature=0.9, top_k=60, top_p=0.9, min_p=0.05, repetition_penalty=3.0)
    ours = torch.isfinite(Sampler(params).process(logits, history))
    theirs = torch.isfinite(_hf_scores(logits, procs, history))
    assert torch.equal(ours, theirs)
    assert torch.equal(ours, torch.isfinite(Sampler(params).process(logits, history)))
    plain = SamplingParams(temperature=0.9, top_k=60, top_p=0.9, min_p=0.05)
    no_penalty = torch.isfinite(Sampler(plain).process(logits))
    assert not torch.equal(ours, no_penalty)


def test_top_k_exact_count_and_top_p_tiny_keeps_one():
    logits = _random_logits(3)
    kept = torch.isfinite(Sampler(SamplingParams(temperature=1.0, top_k=17)).process(logits))
    assert int(kept.sum()) == 17
    assert torch.equal(kept.nonzero().flatten().sort().values, torch.topk(logits, 17).indices.sort().values)

    sampler = Sampler(SamplingParams(temperature=1.0, top_p=1e-9, seed=0))
    kept = torch.isfinite(sampler.process(logits))
    assert int(kept.sum()) == 1
    assert bool(kept[torch.argmax(logits)])
    top = int(torch.argmax(logits))
    assert all(sampler(logits) == top for _ in range(50))


def test_top_p_reaches_threshold_minimally():
    # probabilities 0.5, 0.3, 0.2 (as logits); top_p 0.8 needs exactly two tokens, 0.81 needs three
    logits = torch.log(torch.tensor([0.2, 0.5, 0.3]))
    kept = torch.isfinite(Sampler(SamplingParams(temperature=1.0, top_p=0.75)).process(logits))
    assert kept.tolist() == [False, True, True]
    kept = torch.isfinite(Sampler(SamplingParams(temperature=1.0, top_p=0.45)).process(logits))
    assert kept.tolist() == [False, True, False]
    kept = torch.isfinite(Sampler(SamplingParams(temperature=1.0, top_p=0.85)).process(logits))
    assert kept.tolist() == [True, True, True]


def test_min_p_hand_example():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    # threshold 0.4 * 0.5 = 0.2: keep 0.5 and 0.3
    kept = torch.isfinite(Sampler(SamplingParams(temperature=1.0, min_p=0.4)).process(logits))
    assert kept.tolist() == [True, True, False, False]


def test_tiny_temperature_is_argmax_not_nan():
    logits = _random_logits(11, vocab=50)
    sampler = Sampler(SamplingParams(temperature=1e-30, seed=1))
    scores = sampler.process(logits)
    assert not torch.isnan(scores).any()
    assert all(sampler(logits) == int(torch.argmax(logits)) for _ in range(20))


# --------------------------------------------------------------------------------------------
# the draw itself
# --------------------------------------------------------------------------------------------


def test_empirical_distribution_matches_softmax():
    # 20k draws; each category count is Binomial(n, p) with standard error sqrt(p(1-p)/n) <= 0.0036
    # on the frequency. A 4-sigma band fails by chance with probability ~6e-5 per category, and the
    # seed is fixed, so the test is deterministic; a sampler that ignored the logits (uniform) or
    # used the wrong temperature would be off by many sigmas.
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5])
    probs = torch.softmax(logits, dim=-1).double()
    sampler = Sampler(SamplingParams(temperature=1.0, seed=1234))
    n = 20_000
    counts = torch.zeros(5, dtype=torch.float64)
    for _ in range(n):
        counts[sampler(logits)] += 1
    freq = counts / n
    se = torch.sqrt(probs * (1 - probs) / n)
    assert torch.all((freq - probs).abs() <= 4 * se), (freq, probs)


def test_temperature_changes_the_distribution():
    logits = torch.tensor([1.0, 0.0])
    n = 4000
    hot = Sampler(SamplingParams(temperature=10.0, seed=5))
    cold = Sampler(SamplingParams(temperature=0.25, seed=5))
    hot_zero = sum(hot(logits) == 0 for _ in range(n)) / n  # softmax([.1, 0]) -> 0.525
    cold_zero = sum(cold(logits) == 0 for _ in range(n)) / n  # softmax([4, 0]) -> 0.982
    assert abs(hot_zero - 0.525) < 0.04
    assert abs(cold_zero - 0.982) < 0.01


def _draws(seed, n=50, **kw):
    sampler = Sampler(SamplingParams(temperature=1.0, seed=seed, **kw))
    logits = torch.zeros(1000)  # uniform: every draw carries ~10 bits
    return [sampler(logits) for _ in range(n)]


def test_same_seed_same_sequence_different_seed_different_sequence():
    a = _draws(42)
    b = _draws(42)
    c = _draws(43)
    assert a == b
    assert a != c
    assert len(set(a)) > 10  # really random, not a constant
    # filters consume the generator in the same way
    assert _draws(7, top_k=100, top_p=0.9) == _draws(7, top_k=100, top_p=0.9)


def test_unseeded_samplers_differ_and_record_their_seed():
    s1 = Sampler(SamplingParams(temperature=1.0))
    s2 = Sampler(SamplingParams(temperature=1.0))
    logits = torch.zeros(1000)
    assert [s1(logits) for _ in range(50)] != [s2(logits) for _ in range(50)]
    replay = Sampler(SamplingParams(temperature=1.0, seed=s1.seed))
    s1_again = Sampler(SamplingParams(temperature=1.0, seed=s1.seed))
    assert [replay(logits) for _ in range(20)] == [s1_again(logits) for _ in range(20)]


def test_the_draw_is_multinomials_own():
    """The draw (q ~ Exp(1) from the request's generator, then argmax p / q) is the algorithm
    torch.multinomial uses for one sample: the same token for the same generator state."""
    from kiln.sampling import sample_rows
    for seed in range(20):
        logits = _random_logits(seed, vocab=300)
        logits[::7] = float("-inf")                       # zero probabilities among them
        params = SamplingParams(temperature=0.9, seed=seed)
        ours = Sampler(params)
        theirs = torch.Generator().manual_seed(seed)
        for _ in range(5):
            probs = torch.softmax(ours.process(logits), dim=-1)
            expected = int(torch.multinomial(probs, 1, generator=theirs))
            assert int(sample_rows(logits[None], [ours], [None])) == expected


MIXED = [SamplingParams(temperature=0.8, seed=1),
         SamplingParams(temperature=1.2, top_k=20, seed=2),
         SamplingParams(temperature=0.7, top_p=0.9, seed=3),
         SamplingParams(repetition_penalty=1.3),                      # greedy with a penalty
         SamplingParams(temperature=1.0, min_p=0.05, seed=4),
         SamplingParams(temperature=0.6, top_k=50, top_p=0.8, min_p=0.02, repetition_penalty=1.2, seed=5),
         SamplingParams(temperature=1.0, seed=6),
         SamplingParams(temperature=0.9, top_p=0.5, seed=7)]


@pytest.mark.parametrize("rows", [[0, 1, 2, 3, 4, 5, 6, 7], [2, 7], [3, 5, 1]])
def test_rows_sampled_together_match_each_request_alone(rows):
    """A batch's sampled rows (sample_rows) give each request the scores and the tokens it gets
    alone, step after step: same settings, same seed, the same generator consumed."""
    from kiln.sampling import process_rows, sample_rows
    params = [MIXED[i] for i in rows]
    alone = [Sampler(p) for p in params]
    together = [Sampler(p) for p in params]
    g = torch.Generator().manual_seed(len(rows))
    histories = [torch.randint(0, 500, (int(torch.randint(0, 40, (1,), generator=g)),), generator=g) for _ in rows]
    for step in range(6):
        logits = torch.randn(len(rows), 500, generator=g) * 3
        logits[:, 100 + step] = logits.max() + 1           # ties for the top and near it
        logits[:, 200 + step] = logits[:, 100 + step]
        scores = process_rows(logits, params, histories)
        for j, s in enumerate(alone):
            assert torch.equal(scores[j], s.process(logits[j], histories[j]))
        got = sample_rows(logits, together, histories).tolist()
        want = [s(logits[j], histories[j]) for j, s in enumerate(alone)]
        assert got == want, step
        histories = [torch.cat([h, torch.tensor([t])]) for h, t in zip(histories, want)]


def _mixed(n: int) -> list[SamplingParams]:
    """n settings cycling through MIXED, each with a seed of its own."""
    import dataclasses
    return [dataclasses.replace(MIXED[i % len(MIXED)], seed=None if MIXED[i % len(MIXED)].seed is None else 100 + i)
            for i in range(n)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.filterwarnings("ignore:Synchronization debug mode")
@pytest.mark.parametrize("vocab,rows", [(500, 5), (500, 65), (32000, 65), (248320, 8), (248320, 65)])
def test_cuda_rows_sampled_together_match_alone_without_a_host_sync(vocab, rows):
    """On the GPU (where torch's cumsum sums a row in an order that follows the rows beside it):
    each request's scores and tokens alone and among the others, and no host sync while sampling."""
    from kiln.sampling import process_rows, sample_rows
    params = _mixed(rows)
    alone = [Sampler(p, device="cuda") for p in params]
    together = [Sampler(p, device="cuda") for p in params]
    g = torch.Generator(device="cuda").manual_seed(rows)
    histories = [torch.arange(0, min(vocab, 3000), 7, device="cuda") for _ in params]
    logits = (torch.randn(rows, vocab, generator=g, device="cuda") * 4).bfloat16()
    sample_rows(logits, together, histories)           # warm-up (lazy init may sync)
    [s.draw(logits[j], histories[j]) for j, s in enumerate(alone)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = [sample_rows(logits, together, histories) for _ in range(3)][-1]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = [[int(s.draw(logits[j], histories[j])) for j, s in enumerate(alone)] for _ in range(3)][-1]
    assert got.tolist() == want
    scores = process_rows(logits, params, histories)
    for j, s in enumerate(alone):
        assert torch.equal(scores[j], s.process(logits[j], histories[j])), j


def test_rows_processed_together_equal_the_plain_filters_row_by_row():
    """process_rows against its plain reference, the apply_* chain on each row alone (CPU, random
    scores: no ties for the sorts to order differently)."""
    from kiln.sampling import (
        apply_min_p,
        apply_repetition_penalty,
        apply_temperature,
        apply_top_k,
        apply_top_p,
        process_rows,
    )
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(len(MIXED), 500, generator=g) * 3
    histories = [torch.randint(0, 500, (20,), generator=g) for _ in MIXED]
    got = process_rows(logits, MIXED, histories)
    for j, p in enumerate(MIXED):
        x = apply_repetition_penalty(logits[j].clone(), histories[j], p.repetition_penalty)
        if not p.greedy:
            x = apply_min_p(apply_top_p(apply_top_k(apply_temperature(x, p.temperature), p.top_k), p.top_p), p.min_p)
        assert torch.equal(got[j], x), j


def test_sampling_rows_leaves_the_logits_as_they_were():
    from kiln.sampling import sample_rows
    logits = torch.randn(3, 50)
    before = logits.clone()
    params = [SamplingParams(repetition_penalty=2.0), SamplingParams(temperature=0.5, top_p=0.5, seed=1),
              SamplingParams(temperature=2.0, repetition_penalty=0.5, seed=2)]
    sample_rows(logits, [Sampler(p) for p in params], [torch.arange(10), None, torch.arange(5, 30)])
    assert torch.equal(logits, before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.filterwarnings("ignore:Synchronization debug mode")
def test_cuda_no_host_sync_and_matches_cpu_masks():
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.2, seed=3)
    sampler = Sampler(params, device="cuda")
    logits = _random_logits(0).cuda().half()
    history = torch.arange(0, 100, 3, device="cuda")
    sampler(logits, history)  # warm-up (lazy init may sync)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        scores = sampler.process(logits, history)
        probs = torch.softmax(scores, dim=-1)
        torch.multinomial(probs, 1, generator=sampler.generator)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    tok = sampler(logits, history)
    cpu = Sampler(params).process(logits.cpu(), history.cpu())
    assert torch.equal(torch.isfinite(scores).cpu(), torch.isfinite(cpu))
    assert bool(torch.isfinite(cpu)[tok])
    same = [Sampler(params, device="cuda")(logits, history) for _ in range(2)]
    assert same[0] == same[1]


# --------------------------------------------------------------------------------------------
# StopMatcher
# --------------------------------------------------------------------------------------------


def _run(stops, pieces):
    m = StopMatcher(tuple(stops))
    out = []
    stopped = False
    for p in pieces:
        text, stopped = m.push(p)
        out.append(text)
        if stopped:
            break
    tail = m.flush()
    return out, stopped, tail


def test_stop_split_across_pieces():
    out, stopped, tail = _run(["lo w"], ["Hel", "lo wor", "ld"])
    assert stopped
    assert "".join(out) + tail == "Hel"
    # the trailing "l" of "Hel" could start "lo w", so it is held until the next piece decides
    assert out == ["He", "l"]


def test_stop_split_char_by_char():
    m = StopMatcher(("lo w",))
    emitted = []
    for ch in "Hello world":
        text, stopped = m.push(ch)
        emitted.append(text)
        if stopped:
            break
    assert stopped
    assert "".join(emitted) == "Hel"
    assert m.push("more") == ("", True)
    assert m.flush() == ""


def test_stop_at_very_start():
    out, stopped, tail = _run(["<|end|>"], ["<|end|>", "after"])
    assert stopped and out == [""] and tail == ""
    out, stopped, tail = _run(["<|end|>"], ["<|", "end", "|>tail"])
    assert stopped and "".join(out) == "" and tail == ""


def test_earliest_of_two_stops_wins():
    # "STOP" is listed first but "END" occurs earlier in the text
    out, stopped, _ = _run(["STOP", "END"], ["abc EN", "D xyz STOP"])
    assert stopped and "".join(out) == "abc "
    # both in one piece
    out, stopped, _ = _run(["STOP", "END"], ["a STOP b END"])
    assert stopped and "".join(out) == "a "
    # "abcd" starts earlier but never completes; "bc" inside it does
    out, stopped, _ = _run(["abcd", "bc"], ["ab", "c", "e"])
    assert stopped and "".join(out) == "a"


def test_held_back_prefix_released_when_stop_does_not_complete():
    m = StopMatcher(("</s>",))
    assert m.push("hello <") == ("hello ", False)  # "<" could start "</s>"
    assert m.push("/") == ("", False)  # "</" still could
    assert m.push("x") == ("</x", False)  # disambiguated: released
    assert m.push(" <") == (" ", False)
    assert m.flush() == "<"  # generation ended: held text is released
    assert m.flush() == ""


def test_partial_match_restarts_inside_held_text():
    # "aab" contains the stop "ab" starting inside the held-back "aa"
    out, stopped, _ = _run(["ab"], ["a", "a", "b"])
    assert stopped and "".join(out) == "a"
    # a held prefix that fails but whose suffix begins a new match: "abab" vs "abac"
    out, stopped, _ = _run(["abac"], ["ab", "ab", "ac!"])
    assert stopped and "".join(out) == "ab"


def test_unicode_stops():
    out, stopped, _ = _run(["。\n"], ["你好", "。", "\n再见"])
    assert stopped and "".join(out) == "你好"
    out, stopped, _ = _run(["🙂👍"], ["ok 🙂", "🙂", "👍 no"])
    assert stopped and "".join(out) == "ok 🙂"
    m = StopMatcher(("ß∑",))
    assert m.push("straß") == ("stra", False)
    assert m.push("e") == ("ße", False)
    assert m.push("ß") == ("", False)
    assert m.push("∑x") == ("", True)


def test_flush_and_no_stops():
    m = StopMatcher(())
    assert m.push("anything") == ("anything", False)
    assert m.flush() == ""
    m = StopMatcher(("###",))
    assert m.push("a#") == ("a", False)
    assert m.push("#") == ("", False)
    assert m.flush() == "##"
    assert m.flush() == ""
    with pytest.raises(KilnError):
        StopMatcher(("",))


def _truncate_at_first_stop(text, stops):
    hits = [i for i in (text.find(s) for s in stops) if i != -1]
    return (text[: min(hits)], True) if hits else (text, False)


def test_stop_matcher_property_random_splits():
    rng = random.Random(0)
    alphabet = "ab c\n。é🙂"
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = tuple(
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))
        )
        # random split points, empty pieces allowed
        cuts = sorted(rng.randint(0, len(text)) for _ in range(rng.randint(0, 8)))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert "".join(pieces) == text

        m = StopMatcher(stops)
        emitted, fed, stopped = "", "", False
        for p in pieces:
            out, stopped = m.push(p)
            emitted += out
            fed += p
            if stopped:
                break
            # never emits text a stop could still claim, never holds more than a stop prefix
            _, hit = _truncate_at_first_stop(fed, stops)
            assert not hit
            assert fed.startswith(emitted)
            assert len(fed) - len(emitted) < max(map(len, stops))
        if not stopped:
            emitted += m.flush()
        expected, hit = _truncate_at_first_stop(text, stops)
        assert (emitted, stopped) == (expected, hit), (text, stops, pieces)


# --------------------------------------------------------------------------------------------
# SamplingParams
# --------------------------------------------------------------------------------------------


def test_params_defaults_and_stop_normalisation():
    p = SamplingParams()
    p.validate()
    assert p.greedy and p.stop == ()
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert not SamplingParams(temperature=0.5).greedy
    SamplingParams(max_new_tokens=1, temperature=2.0, top_k=5, top_p=0.5, min_p=1.0,
                   repetition_penalty=0.5, seed=0, stop=("x",)).validate()


@pytest.mark.parametrize(
    "bad",
    [
        dict(max_new_tokens=0),
        dict(max_new_tokens=-3),
        dict(max_new_tokens=2.5),
        dict(temperature=-0.1),
        dict(temperature=float("nan")),
        dict(temperature=float("inf")),
        dict(top_k=-1),
        dict(top_k=1.5),
        dict(top_p=0.0),
        dict(top_p=1.01),
        dict(top_p=-0.5),
        dict(top_p=float("nan")),
        dict(min_p=-0.01),
        dict(min_p=1.5),
        dict(min_p=float("nan")),
        dict(repetition_penalty=0.0),
        dict(repetition_penalty=-1.0),
        dict(repetition_penalty=float("inf")),
        dict(stop=("ok", "")),
        dict(stop=""),
        dict(seed=-1),
        dict(seed=1.5),
        dict(seed="7"),
        dict(seed=True),
        dict(seed=2**64),
    ],
)
def test_validate_rejects(bad):
    params = SamplingParams(**bad)
    with pytest.raises(KilnError) as exc:
        params.validate()
    assert "\n" not in str(exc.value)
    with pytest.raises(KilnError):
        Sampler(params)


def _aten_scan_threads(rows: int, vocab: int) -> int:
    """log2 of the threads a row of ATen's CUDA cumsum over the last dim (get_log_num_threads_x_inner_scan),
    None where it takes CUB's whole-tensor scan instead (a single row)."""
    if rows == 1:
        return None
    lx, ly = (vocab - 1).bit_length(), (rows - 1).bit_length()
    return min(9, max(4, (9 + lx - ly) // 2))


@pytest.mark.parametrize("vocab", [317, 500, 512, 513, 1024, 2048, 32000, 49152, 128256, 248320, 262144])
def test_cuda_scan_groups_give_every_row_the_same_threads(vocab):
    """The top-p tail sums on CUDA: whatever the batch, every group _row_cumsum scans (a lone row
    padded to two) gets the threads a row that one row padded to two gets, so a row sums in one order."""
    from kiln.sampling import scan_groups
    alone = _aten_scan_threads(2, vocab)
    for rows in (1, 2, 3, 5, 8, 17, 64, 65, 300, 513, 1100):
        groups = scan_groups(rows, vocab)
        assert groups[0][0] == 0 and groups[-1][1] == rows
        assert all(a < b and b == c for (a, b), (c, _) in zip(groups, groups[1:]))
        assert {_aten_scan_threads(max(b - a, 2), vocab) for a, b in groups} == {alone}
    if vocab >= 248320:
        assert len(scan_groups(64, vocab)) == 1          # a real vocabulary: one scan for a whole batch
