"""Expert streaming (kiln/weights/experts.py, docs/streaming.md): a tiny quantised MoE model, packed,
streamed from disk and from host memory under every policy with fewer slots than experts, gives the
resident model's logits bit for bit and its greedy tokens (reference backend); the store's hits,
misses and bytes equal an independent simulation of the policy over the routing it recorded; an
expert file cut short or changed during a run is a one-line error."""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from pathlib import Path

import pytest
import torch

import kiln
from kiln.cli import main as cli_main
from kiln.errors import KilnError
from kiln.models import model_config
from kiln.weights.synth import CONFIGS, Synthesis, write_checkpoint

PROMPT = [5, 17, 200, 33, 91, 4, 250, 12, 7, 30, 66, 2, 140, 9, 77, 310]
SLOTS = 3          # of 8 experts a layer, 2 a token: evictions at decode, batches at prefill


def pack_tiny_moe(root: Path) -> Path:
    """tiny-qwen3.5-moe-p2 (8 experts a layer, top-2) drawn with seed 7, packed with 4-bit weights."""
    config = dict(CONFIGS["tiny-qwen3.5-moe-p2"])
    cls, cfg = model_config(config)
    drawn = Synthesis(config, cls.checkpoint_shapes(cfg), cls.norm_style == "offset", seed=7)
    src = write_checkpoint(drawn, root / "hf", "tiny-qwen3.5-moe-p2", dtype="bf16", quiet=True)
    out = root / "packed"
    assert cli_main(["pack", str(src), str(out), "--quiet", "--bits", "4", "--group-size", "32"]) == 0
    return out


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    out = pack_tiny_moe(tmp_path_factory.mktemp("stream"))
    layers = json.loads((out / "manifest.json").read_text())["experts"]["layers"]
    assert layers and all("quant" in r for layer in layers for r in layer["tensors"].values())
    return out


def load(path: Path, **streaming):
    return kiln.load(str(path), device="cpu", backend="reference", dtype="f32", **streaming)


def logits_and_tokens(llm, n: int = 8):
    """The prompt's last logits and each decode step's, on a fresh state; the greedy tokens."""
    eng = llm.engine
    state = eng.new_state(len(PROMPT) + n)
    out = [eng.prefill(PROMPT, state)]
    tokens = []
    for k in range(n):
        tokens.append(int(torch.argmax(out[-1])))
        out.append(eng.decode_step(tokens[-1], len(PROMPT) + k, state))
    return torch.stack(out), tokens


@pytest.fixture(scope="module")
def resident(packed):
    return logits_and_tokens(load(packed))


@pytest.fixture(scope="module")
def profile(packed, tmp_path_factory) -> Path:
    """A routing profile recorded by a streamed run (the static policy's hot set)."""
    llm = load(packed, expert_cache_slots=SLOTS, expert_policy="lru")
    logits_and_tokens(llm, 4)
    path = tmp_path_factory.mktemp("profile") / "profile.json"
    path.write_text(json.dumps(llm.model.expert_store.profile()))
    return path


@pytest.mark.parametrize("home", ("disk", "host"))
@pytest.mark.parametrize("policy", ("lfu", "lru", "static", "os"))
def test_streamed_logits_and_tokens_are_the_resident_ones(packed, resident, profile, home, policy):
    """Bitwise: the same ops on the same values in the same order (each expert's weight dequantised
    into a fresh tensor from its stack or from its slot copy, its rows' output added in id order)."""
    extra = {"expert_profile": profile} if policy == "static" else {}
    llm = load(packed, expert_cache_slots=SLOTS, expert_policy=policy, expert_home=home, **extra)
    logits, tokens = logits_and_tokens(llm)
    assert torch.equal(logits, resident[0]), (home, policy)
    assert tokens == resident[1]
    store = llm.model.expert_store
    assert store.home_tier == home
    check_accounting(store, policy, SLOTS)
    if home == "host":      # static's hot set lives in its slots only: the host holds the other experts
        held = sum(x.nbytes for h in store.homes.values() for w in h.stacks.values()
                   for x in (w.packed, w.scales, w.biases))
        assert store.summary()["host_bytes"] == held and store.summary()["host_pinned_bytes"] == 0   # (CPU)
        for p, h in store.homes.items():
            hot = store.caches[p].hot
            assert (h.rows is not None) == (policy == "static") and (policy != "static" or len(hot) > 0)
            assert next(iter(h.stacks.values())).shape[0] == 8 - len(hot)
            assert sorted(h.rows or range(8)) == sorted(set(range(8)) - set(hot))


def test_auto_home_weighs_the_experts_as_they_will_be_held(packed):
    """--host-memory against the experts' bytes as held (4-bit words, scales and biases in the load's
    dtype), not a 16-bit estimate: between the two the experts stay in host memory; under both, disk."""
    from kiln.weights import open_checkpoint
    from kiln.weights.experts import STACKS, weight_bytes

    ckpt = open_checkpoint(str(packed))
    names = [n for n in ckpt.shapes if n.endswith(STACKS)]
    held = sum(weight_bytes(ckpt, names, torch.float32).values())
    sixteen = 2 * sum(torch.Size(ckpt.shapes[n]).numel() for n in names)
    assert 0 < held < sixteen / 2
    for gb, tier in (((held + sixteen) / 2e9, "host"), (held / 2e9, "disk")):
        llm = load(packed, expert_cache_slots=SLOTS, host_memory=gb)
        assert llm.model.expert_store.home_tier == tier, (gb, tier)


def test_auto_home_without_host_memory_is_disk_past_the_hosts_room(packed, monkeypatch, capsys):
    """No --host-memory: the experts stay in host memory while they fit host_room(); past it a packed
    directory streams them from disk (a [kiln] line says why), and another checkpoint stays in host
    memory with a warning naming kiln pack."""
    from kiln.weights import experts

    src = packed.parent / "hf"
    assert (src / "config.json").exists()
    monkeypatch.setattr(experts, "host_room", lambda: 10 ** 12)
    assert load(packed, expert_cache_slots=SLOTS).model.expert_store.home_tier == "host"
    monkeypatch.setattr(experts, "host_room", lambda: 1000)
    capsys.readouterr()
    assert load(packed, expert_cache_slots=SLOTS).model.expert_store.home_tier == "disk"
    assert "more than the 1e-06 GB of host memory kiln takes by default (75% of the available): streamed " \
        "from disk" in capsys.readouterr().err
    assert load(src, expert_cache_slots=SLOTS).model.expert_store.home_tier == "host"
    assert re.search(r"\[kiln\] warning: the routed experts take .* they stay in host memory \(kiln pack ",
                     capsys.readouterr().err)


def test_host_room_reads_the_available_memory():
    from kiln.weights.experts import HOST_SHARE, host_room

    room = host_room()
    if room is None:
        pytest.skip("no /proc/meminfo here")
    available = next(int(ln.split()[1]) * 1024 for ln in open("/proc/meminfo") if ln.startswith("MemAvailable:"))
    assert 0 < room <= available and abs(room - HOST_SHARE * available) < 0.05 * available


def test_direct_io_reads_give_the_resident_logits(packed, resident):
    """O_DIRECT reads (page-aligned buffers, 4 KiB-aligned blobs), every expert read every step."""
    llm = load(packed, expert_cache_slots=SLOTS, expert_policy="os", expert_home="disk", direct_io=True)
    try:
        logits, tokens = logits_and_tokens(llm)
    except KilnError as e:
        if "does not take direct I/O" in str(e):
            pytest.skip(str(e))
        raise
    assert torch.equal(logits, resident[0]) and tokens == resident[1]
    assert all(h.direct for h in llm.model.expert_store.homes.values())


# -- accounting against an independent simulation --------------------------------------------------

def simulate(policy: str, slots: int, steps: list[list[int]], hot: list[int]) -> tuple[int, int]:
    """(hits, misses) of one layer over its steps (each the ascending ids it needed), by the rules
    docs/streaming.md states: a step in batches of `slots` ids (static: of `slots` misses), the clock
    ticking once a batch, lru evicting the oldest use, lfu the fewest uses then the oldest, ties to
    the lower id; static's hot set never a miss, never evicted; os missing everything."""
    cache, uses, last, clock, hits, misses = set(), Counter(), {}, 0, 0, 0
    for needed in steps:
        batches, cur, loads = [], [], 0
        for e in needed:
            miss = policy != "static" or e not in hot
            if cur and ((policy != "static" and len(cur) == slots) or (miss and loads == slots)):
                batches.append(cur)
                cur, loads = [], 0
            cur.append(e)
            loads += miss
        batches += [cur] if cur else []
        for batch in batches:
            clock += 1
            for e in batch:
                uses[e] += 1
                last[e] = clock
            for e in batch:
                if policy == "os" or (policy == "static" and e not in hot):
                    misses += 1
                elif policy == "static" or e in cache:
                    hits += 1
                else:
                    misses += 1
                    if len(cache) == slots:
                        rank = (lambda x: (last[x], x)) if policy == "lru" else (lambda x: (uses[x], last[x], x))
                        cache.remove(min(cache - set(batch), key=rank))
                    cache.add(e)
    return hits, misses


def check_accounting(store, policy: str, slots: int) -> None:
    for layer, stats in store.stats.items():
        steps = [needed for name, needed in store.trace if name == layer]
        hot = store.caches[layer].hot
        hits, misses = simulate(policy, slots, steps, hot)
        assert (stats.hits, stats.misses) == (hits, misses), (layer, policy)
        assert stats.bytes == misses * store.homes[layer].nbytes()
        assert hits + misses == sum(len(s) for s in steps)
    summary = store.summary()
    assert summary["policy"] == policy and summary["slots"] == slots
    assert summary["hits"] + summary["misses"] == sum(len(s) for _, s in store.trace)


def test_the_simulation_itself_counts_a_known_sequence():
    """lru over 2 slots: 1,2 miss; 1 hits; 3 evicts 2; 2 misses again (evicting 1, the older)."""
    assert simulate("lru", 2, [[1, 2], [1], [3], [2]], []) == (1, 4)
    assert simulate("lfu", 2, [[1, 2], [1], [3], [2]], []) == (1, 4)      # 3 evicts 2 (one use), 2 evicts 3
    assert simulate("os", 2, [[1, 2], [1]], []) == (0, 3)
    assert simulate("static", 1, [[1, 2, 3]], [2]) == (1, 2)


# -- a damaged expert file during a run ------------------------------------------------------------

def copy_packed(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.rglob("*"):
        if p.is_file():
            q = dst / p.relative_to(src)
            q.parent.mkdir(parents=True, exist_ok=True)
            q.write_bytes(p.read_bytes())
    return dst


@pytest.mark.parametrize("damage", ("truncate", "rewrite"))
def test_an_expert_file_damaged_during_a_run_is_a_one_line_error(packed, tmp_path, damage):
    d = copy_packed(packed, tmp_path / "m")
    llm = load(d, expert_cache_slots=SLOTS, expert_policy="os", expert_home="disk")
    llm.generate(PROMPT, max_new_tokens=2, temperature=0)
    victim = d / "experts" / "layer_000.bin"
    if damage == "truncate":
        os.truncate(victim, victim.stat().st_size // 2)
    else:
        data = bytearray(victim.read_bytes())
        data[100] ^= 0xFF
        victim.write_bytes(bytes(data))
        st = victim.stat()
        os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    with pytest.raises(KilnError) as e:
        llm.generate(PROMPT, max_new_tokens=2, temperature=0)
    assert "layer_000.bin" in str(e.value) and "\n" not in str(e.value)


def test_streaming_flags_on_the_cli(packed, capsys):
    assert cli_main(["run", str(packed), "--device", "cpu", "--backend", "reference", "--dtype", "f32",
                     "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new", "3", "--temperature", "0",
                     "--expert-cache-slots", "2", "--expert-policy", "lru", "--expert-home", "disk", "--quiet"]) == 0
    assert cli_main(["run", str(packed), "--device", "cpu", "--expert-policy", "static", "--quiet",
                     "--prompt-ids", "1,2"]) == 2
    assert "static needs a routing profile" in capsys.readouterr().err


# -- routing skew in synthesized models --------------------------------------------------------------

def test_a_skewed_synth_router_concentrates_routing_and_raises_the_hit_rate():
    """skew=2 against the plain draw, same seed and sampling: the most used expert of a layer takes a
    larger share (the mean over the 4 layers: one layer's 480 picks of 8 experts are noisy) and 3 lfu
    slots of 8 hit more often (measured 0.40 -> 0.53; shares 0.17 -> 0.26, one layer's 0.16-0.31)."""
    rate, top = {}, {}
    for skew in (0, 2):
        llm = kiln.load(f"synth:tiny-qwen3.5-moe-p2:seed=3:skew={skew}", device="cpu", backend="reference",
                        dtype="f32", expert_cache_slots=3, expert_policy="lfu")
        for seed in (1, 2):     # two sampled sequences: the rates are statistics of the routing, not one path's
            llm.generate([5, 17, 200, 33, 91, 4, 250, 12], max_new_tokens=120, temperature=1.0, seed=seed)
        store = llm.model.expert_store
        layers = {layer for layer, _ in store.trace}
        uses = [Counter(e for at, needed in store.trace if at == layer for e in needed) for layer in layers]
        rate[skew] = store.summary()["hit_rate"]
        top[skew] = sum(max(u.values()) / sum(u.values()) for u in uses) / len(uses)
    assert rate[2] > rate[0] + 0.08 and top[2] > top[0] + 0.05, (rate, top)


def test_skew_is_a_spec_option_within_bounds():
    from kiln.weights.synth import parse_spec

    assert parse_spec("synth:tiny-qwen3.5-moe-p2:skew=1.5").skew == 1.5
    for bad in ("synth:tiny-qwen3.5-moe-p2:skew=9", "synth:tiny-qwen3.5-moe-p2:skew=-1",
                "synth:tiny-qwen3.5-moe-p2:skew=x"):
        with pytest.raises(KilnError):
            parse_spec(bad)


def test_streamed_decode_on_the_cuda_backend_runs_the_resident_kernels_on_the_slots():
    """One token a call, 2 of 8 quantised experts, 3 lru slots (evictions), the cuda backend's MoE op
    (Triton's interpreter on CPU): the resident decode kernels read the slots through the row table,
    so each output is the resident op's bit for bit, with and without the gated shared expert."""
    pytest.importorskip("triton")
    from kiln.backends.cuda import CudaOps
    from kiln.ops.quant import kernels
    from kiln.ops.quant.reference import quantize
    from kiln.weights.experts import ExpertStore, HostHome

    e, k, h, i, dt = 8, 2, 128, 64, torch.bfloat16
    g = torch.Generator().manual_seed(0)
    gate_up = quantize((torch.randn(e, 2 * i, h, generator=g) * h ** -0.5).to(dt), 4, 64)
    down = quantize((torch.randn(e, h, i, generator=g) * i ** -0.5).to(dt), 4, 64)
    store = ExpertStore({"l.": HostHome({"l.gu": gate_up, "l.dn": down})}, "cpu", "lru", 3)
    gu_h, dn_h = store.handle("l.", "l.gu", gate_up.shape), store.handle("l.", "l.dn", down.shape)
    ops, calls, real = CudaOps(torch.device("cpu")), [], kernels.qgemv_pairs
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "qgemv_pairs", lambda *a, **kw: calls.append(1) or real(*a, **kw))
        for step in range(4):
            x = torch.randn(1, h, generator=g).to(dt)
            idx = torch.randperm(e, generator=g)[:k][None]
            w = torch.rand(1, k, generator=g).to(dt)
            gate_w, shared = torch.randn(1, h, generator=g).to(dt), torch.randn(1, h, generator=g).to(dt)
            assert torch.equal(ops.moe_experts(x, idx, w, gu_h, dn_h, "silu"),
                               ops.moe_experts(x, idx, w, gate_up, down, "silu")), step
            assert torch.equal(ops.moe_experts_gated(x, idx, w, gu_h, dn_h, "silu", gate_w, shared),
                               ops.moe_experts_gated(x, idx, w, gate_up, down, "silu", gate_w, shared)), step
    assert len(calls) == 4 * 4 * 2      # 4 calls a step (streamed and resident, plain and gated), 2 launches each
    assert store.summary()["misses"] > 3


@pytest.mark.parametrize("policy,bits", [("lru", 4), ("static", 3), ("lru", 16)])
def test_a_streamed_prefill_on_the_cuda_backend_runs_each_batch_through_the_grouped_kernels(policy, bits):
    """A prefill chunk (9 tokens, 2 of 8 quantised experts each) through 3 slots: each batch's experts
    read from the slots by the grouped kernels, packed (4-bit: quant/grouped.py) or gathered and
    dequantised in one launch a stack (3-bit, whose values cross words: in parts that fit the room),
    one combine at the end (the 397B's prefill took the per-expert loop: 4.2 tok/s resident, the same
    loop as here). The resident cuda path's values (the same kernels) within the tile forms' rounding,
    plain and gated; no expert computed alone. 16-bit experts take the gathered path (their slots
    gathered as they are)."""
    pytest.importorskip("triton")
    from kiln.backends.cuda import CudaOps
    from kiln.ops.quant import cuda as quant_cuda
    from kiln.ops.quant.reference import quantize
    from kiln.weights.experts import ExpertStore, HostHome

    e, k, h, i, t, dt = 8, 2, 64, 32, 9, torch.bfloat16
    g = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(e, 2 * i, h, generator=g) * h ** -0.5).to(dt)
    down = (torch.randn(e, h, i, generator=g) * i ** -0.5).to(dt)
    if bits < 16:
        gate_up, down = quantize(gate_up, bits, 32), quantize(down, bits, 32)
    profile = {"l.": {"3": 9, "1": 5, "6": 2}} if policy == "static" else None
    store = ExpertStore({"l.": HostHome({"l.gu": gate_up, "l.dn": down})}, "cpu", policy, 3, profile=profile)
    gu_h, dn_h = store.handle("l.", "l.gu", gate_up.shape), store.handle("l.", "l.dn", down.shape)
    ops, batches, alone, parts = CudaOps(torch.device("cpu")), [], [], []
    real, real_gather = ops.slot_pairs, quant_cuda.gathered_stacks
    with pytest.MonkeyPatch.context() as mp, torch.inference_mode():
        mp.setattr(ops, "slot_pairs",
                   lambda x, idx, w, where, *a: batches.append(sorted(where)) or real(x, idx, w, where, *a))
        mp.setattr(ops, "expert_out", lambda *a: alone.append(1))
        if policy == "static":      # a batch's copies in parts of 2 experts (room for no more)
            room = 2 * quant_cuda.expert_bytes(gate_up, down)
            mp.setattr("kiln.ops.moe.cuda.stack_room", lambda x: room)
            mp.setattr(quant_cuda, "stack_room", lambda x: room)
        mp.setattr("kiln.ops.moe.cuda.gathered_stacks",
                   lambda stacks, slots: parts.append(slots.numel()) or real_gather(stacks, slots))
        for gated in (False, True):
            x = torch.randn(t, h, generator=g).to(dt)
            idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
            w = torch.rand(t, k, generator=g).to(dt)
            gate = (x[:1].clone(), torch.randn(t, h, generator=g).to(dt)) if gated else None
            run = (lambda gu, dn: ops.moe_experts_gated(x, idx, w, gu, dn, "silu", *gate)) if gated else (
                lambda gu, dn: ops.moe_experts(x, idx, w, gu, dn, "silu"))
            got, want = run(gu_h, dn_h), run(gate_up, down)
            row = want.float().abs().amax(dim=1, keepdim=True)
            ulp = 2.0 ** (torch.floor(torch.log2(row)) + 1) * torch.finfo(dt).eps / 2
            assert ((got.float() - want.float()).abs() <= (k + 2) * ulp).all(), gated
            assert (got == want).float().mean() >= 0.9
    needed = [n for _, n in store.trace]        # each call's experts, every one in exactly one batch
    slots = store._slots("l.")["l.gu"].shape[0]      # static: its hot slots and scratch
    assert sorted(sum(batches, [])) == sorted(needed[0] + needed[1]) and len(batches) >= 2
    assert all(len(b) <= slots for b in batches) and not alone
    assert parts == [] if bits == 4 else parts          # 4-bit read packed: no copies
    assert policy != "static" or max(parts) <= 2


def test_the_bench_reports_the_expert_store(packed, tmp_path):
    out = tmp_path / "b.json"
    assert cli_main(["bench", str(packed), "--device", "cpu", "--backend", "reference", "--dtype", "f32",
                     "--prompt-lengths", "16", "--gen", "4", "--runs", "1", "--expert-cache-slots", "3",
                     "--expert-home", "disk", "--json", str(out), "--quiet"]) == 0
    report = json.loads(out.read_text())
    s = report["expert_store"]
    assert s["policy"] == "lfu" and s["slots"] == 3 and s["home"] == "disk" and s["misses"] > 0
    assert s["bytes_per_token"] == s["bytes"] / s["tokens"] and report["bytes_per_token"] > 0
    rates = s["rates_gb_s"]         # measured: random expert reads by the I/O threads; no link on the CPU
    assert rates["disk"] > 0 and rates["copy"] is None and rates["in_place"] is None
    assert s["io_bound_tok_s"] == round(rates["disk"] * 1e9 / s["bytes_per_token"], 2)


def test_streaming_refusals_are_one_line_errors(packed, tmp_path):
    hf = packed.parent / "hf"
    with pytest.raises(KilnError, match="read from a packed directory"):
        load(hf, expert_cache_slots=2, expert_home="disk")
    with pytest.raises(KilnError, match="apply to expert streaming"):
        load(packed, expert_home="disk")
    with pytest.raises(KilnError, match="must be at least 1"):
        load(packed, expert_cache_slots=0)
    with pytest.raises(KilnError, match="apply to expert streaming"):
        load(packed, zero_copy="on")
    bad = tmp_path / "p.json"
    bad.write_text("{not json")
    with pytest.raises(KilnError, match="--expert-profile"):
        load(packed, expert_policy="static", expert_profile=bad)
    assert load(hf, expert_cache_slots=2).model.expert_store.home_tier == "host"     # an HF folder streams from host


def test_a_saved_profile_drives_the_static_policy(packed, resident, tmp_path):
    """`kiln run --save-expert-profile` writes the routing counts; `--expert-policy static` reads them
    back as its hot set (the `slots` most used experts of each layer) and gives the resident tokens."""
    prof = tmp_path / "routing.json"
    ids = ",".join(map(str, PROMPT))
    assert cli_main(["run", str(packed), "--device", "cpu", "--backend", "reference", "--dtype", "f32",
                     "--prompt-ids", ids, "--max-new", "6", "--temperature", "0", "--expert-cache-slots", "3",
                     "--save-expert-profile", str(prof), "--quiet"]) == 0
    counts = json.loads(prof.read_text())
    assert sorted(counts) == sorted(json.loads((packed / "manifest.json").read_text())["experts"]["layers"][i]["prefix"]
                                    for i in range(len(counts)))
    llm = load(packed, expert_cache_slots=SLOTS, expert_policy="static", expert_profile=prof)
    logits, tokens = logits_and_tokens(llm)
    assert torch.equal(logits, resident[0]) and tokens == resident[1]
    for layer, cache in llm.model.expert_store.caches.items():
        top = sorted(counts[layer].items(), key=lambda kv: (-kv[1], int(kv[0])))[:SLOTS]
        assert cache.hot == [int(e) for e, _ in top]
    assert cli_main(["run", str(packed), "--device", "cpu", "--prompt-ids", ids, "--quiet",
                     "--save-expert-profile", str(prof)]) == 2         # not streamed: refused before the load


# -- zero-copy: misses read in place by the cuda backend's decode kernels -----------------------------

def simulate_in_place(policy: str, slots: int, steps: list[list[int]], hot: list[int]) -> tuple[int, int, int]:
    """(hits, misses, promotions) of one layer whose misses are read in place, by docs/streaming.md's
    rules: the clock ticks once a step; after it, free slots take misses first, then lru promotes any
    miss over the least recent cached expert not needed, lfu a miss used more often than the least
    used such expert (most used misses first); static (its hot set fixed) and os never promote."""
    cache, uses, last, hits, misses, promoted = set(hot), Counter(), {}, 0, 0, 0
    for clock, needed in enumerate(steps, 1):
        for e in needed:
            uses[e] += 1
            last[e] = clock
        missing = [e for e in needed if e not in cache]
        hits, misses = hits + len(needed) - len(missing), misses + len(missing)
        if policy in ("static", "os"):
            continue
        rank = (lambda x: (last[x], x)) if policy == "lru" else (lambda x: (uses[x], last[x], x))
        for e in sorted(missing, key=lambda e: (-uses[e], e)) if policy == "lfu" else missing:
            if len(cache) == slots:
                others = cache - set(needed)
                victim = min(others, key=rank) if others else None
                if victim is None or (policy == "lfu" and uses[e] <= uses[victim]):
                    break
                cache.remove(victim)
            cache.add(e)
            promoted += 1
    return hits, misses, promoted


def disk_home(path: Path, stacks: dict):
    """A DiskHome over a layer file written here by packed's layout rules: each expert one blob of
    `stride` bytes (4 KiB-aligned), its stacks' parts at 64-byte aligned offsets."""
    from kiln.weights.experts import DiskHome
    from kiln.weights.packed import DTYPE_NAMES, align
    from kiln.weights.upload import placed

    records, offset = {}, 0
    for name, w in stacks.items():
        parts = {}
        for part, t in (("weight", w.packed), ("scales", w.scales), ("biases", w.biases)):
            nbytes = t[0].numel() * t.element_size()
            parts[part] = {"offset": offset, "nbytes": nbytes, "dtype": DTYPE_NAMES[t.dtype],
                           "shape": list(t.shape[1:])}
            offset = align(offset + nbytes, 64)
        records[name] = {"parts": parts, "quant": {"bits": w.bits, "group_size": w.group_size}}
    stride, count = align(offset, 4096), next(iter(stacks.values())).packed.shape[0]
    blob = bytearray(stride * count)
    for e in range(count):
        for name, w in stacks.items():
            for part, t in (("weight", w.packed), ("scales", w.scales), ("biases", w.biases)):
                p = records[name]["parts"][part]
                raw = t[e].contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
                blob[e * stride + p["offset"]: e * stride + p["offset"] + p["nbytes"]] = raw
    path.write_bytes(bytes(blob))
    return DiskHome(path, stride, count, records, lambda stored: placed(stored, w.scales.dtype, "cpu"))


@pytest.mark.parametrize("home,policy,stage", [("host", "lfu", "1"), ("host", "lru", "1"), ("host", "static", "1"),
                                               ("compact", "static", "1"), ("compact", "static", "0"),
                                               ("host", "os", "0"), ("disk", "lfu", "1")])
def test_zero_copy_decode_reads_misses_in_place_and_gives_the_resident_outputs(home, policy, stage, tmp_path,
                                                                               monkeypatch):
    """One token a call, 2 of 8 quantised experts, 3 slots, the cuda backend's MoE op (Triton's
    interpreter on CPU) with zero-copy on: each pair's expert is read from its slot, or from host memory
    (staged into device scratch by one copy kernel; KILN_STAGE_MISSES=0: in place by the GEMVs; from
    disk: the pinned staging its read landed in), so every output is the resident op's bit for bit,
    plain and gated; the hits, misses, promotions and bytes equal simulate_in_place over the recorded
    routing. From host memory every third call is prefetched first (ops.moe_prefetch: the misses staged
    ahead, on a side stream on a GPU), which changes no output and no count. `compact`: static with its
    hot set in the slots only, the host stacks cut to the other experts (ExpertStore.compact): the
    same outputs and counts."""
    pytest.importorskip("triton")
    monkeypatch.setenv("KILN_STAGE_MISSES", stage)
    from kiln.backends.cuda import CudaOps
    from kiln.ops.quant import kernels
    from kiln.ops.quant.reference import quantize
    from kiln.weights.experts import ExpertStore, HostHome

    e, k, h, i, dt, slots = 8, 2, 64, 64, torch.bfloat16, 3
    g = torch.Generator().manual_seed(1)
    gate_up = quantize((torch.randn(e, 2 * i, h, generator=g) * h ** -0.5).to(dt), 4, 64)
    down = quantize((torch.randn(e, h, i, generator=g) * i ** -0.5).to(dt), 4, 64)
    profile = {"l.": {"3": 9, "1": 5, "6": 2, "0": 1}}
    stacks = {"l.gu": gate_up, "l.dn": down}
    compact, home = home == "compact", "host" if home == "compact" else home
    where = HostHome(dict(stacks)) if home == "host" else disk_home(tmp_path / "layer.bin", stacks)
    store = ExpertStore({"l.": where}, "cpu", policy, slots, profile=profile if policy == "static" else None,
                        zero_copy=True)
    if compact:
        store.compact("l.")
        assert where.rows == {0: 0, 2: 1, 4: 2, 5: 3, 7: 4}      # 3, 1 and 6: the hot set, in the slots
        assert where.stacks["l.gu"].packed.shape[0] == 5
        assert torch.equal(where.read(4)["l.dn"].packed, down.packed[4])
    gu_h, dn_h = store.handle("l.", "l.gu", gate_up.shape), store.handle("l.", "l.dn", down.shape)
    assert gu_h.nbytes == gate_up.nbytes and dn_h.nbytes == down.nbytes      # the whole stack's, as resident
    ops, hosts, real = CudaOps(torch.device("cpu")), [], kernels.qgemv_pairs
    # inference mode, as a model runs: the slots and staging are made in it, and the I/O threads
    # that write the staging are not in it (inference mode is a thread's)
    with pytest.MonkeyPatch.context() as mp, torch.inference_mode():
        mp.setattr(kernels, "qgemv_pairs", lambda *a, **kw: hosts.append(int((a[2] < 0).sum())) or real(*a, **kw))
        for step, pick in enumerate([3, 1, 5, 3, 1, 0, 7, 3, 2, 1]):    # a popular expert, then another
            x = torch.randn(1, h, generator=g).to(dt)
            idx = torch.tensor([[pick, (pick + 1 + step) % e]])
            w = torch.rand(1, k, generator=g).to(dt)
            if step % 3 == 0:
                ops.moe_prefetch(idx, gu_h, dn_h)
                assert (idx is store.ahead.get("l.", (None,))[0]) == (home == "host" and stage == "1")
            if step % 2:
                gate_w, shared = torch.randn(1, h, generator=g).to(dt), torch.randn(1, h, generator=g).to(dt)
                assert torch.equal(ops.moe_experts_gated(x, idx, w, gu_h, dn_h, "silu", gate_w, shared),
                                   ops.moe_experts_gated(x, idx, w, gate_up, down, "silu", gate_w, shared)), step
            else:
                assert torch.equal(ops.moe_experts(x, idx, w, gu_h, dn_h, "silu"),
                                   ops.moe_experts(x, idx, w, gate_up, down, "silu")), step
    if home == "host":
        with torch.inference_mode():
            store.moe(ops, x, idx, w, gu_h, dn_h, "silu")      # settles the last call's ids
    assert sum(hosts) > 0 and store.zero_copy and not store.ahead    # some pairs read in place; prefetches used
    steps = [needed for _, needed in store.trace]       # host: every call but the last, still pending
    assert len(steps) == 10
    stats = store.stats["l."]
    hits, misses, promoted = simulate_in_place(policy, slots, steps, store.caches["l."].hot)
    assert (stats.hits, stats.misses, stats.promoted) == (hits, misses, promoted), policy
    read = misses + (promoted if home == "host" else 0)     # from disk, a promotion copies the staged read
    assert stats.bytes == read * store.homes["l."].nbytes()
    assert (promoted > 0) == (policy in ("lfu", "lru"))


def test_the_in_place_simulation_counts_a_known_sequence():
    """lru, 2 slots: 1,2 fill the slots; 1 hits; 3 evicts 2 (older); 2 evicts 1. lfu: 3 (one use) is
    not promoted over 2 (one use); 2 hits; 3's second use is not promoted over 1 (two uses)."""
    assert simulate_in_place("lru", 2, [[1, 2], [1], [3], [2]], []) == (1, 4, 4)
    assert simulate_in_place("lfu", 2, [[1, 2], [1], [3], [2], [3]], []) == (2, 4, 2)
    assert simulate_in_place("os", 2, [[1, 2], [1]], []) == (0, 3, 0)
    assert simulate_in_place("static", 1, [[1, 2, 3]], [2]) == (1, 2, 0)


def test_the_staging_kernel_equals_its_reference():
    """staging.stage (Triton's interpreter on CPU) against stage_reference: ragged part widths (one
    past a program's block, one under it), hits left alone, misses copied to their pair's row."""
    pytest.importorskip("triton")
    from kiln.ops.moe import staging

    g = torch.Generator().manual_seed(3)
    e, pairs = 6, 5
    widths = (staging.BLOCK + 37, 50, 3)
    host = [torch.randint(-2**31, 2**31 - 1, (e, w), generator=g, dtype=torch.int32) for w in widths]
    idx = torch.tensor([4, 0, 5, 2, 1])
    table = torch.tensor([-1, 0, -3, -4, 1, -6], dtype=torch.int32)       # experts 1 and 4 in slots 0 and 1
    got_scratch = [torch.zeros(pairs, w, dtype=torch.int32) for w in widths]
    want_scratch = [torch.zeros(pairs, w, dtype=torch.int32) for w in widths]
    rows = staging.stage(idx, table, host, got_scratch)
    want = staging.stage_reference(idx, table, host, want_scratch)
    assert torch.equal(rows, want) and rows.tolist() == [1, -2, -3, -4, 0]
    for a, b in zip(got_scratch, want_scratch):
        assert torch.equal(a, b)
    assert torch.equal(got_scratch[0][1], host[0][0]) and not got_scratch[0][0].any()   # a hit copies nothing
    # a compacted host (ExpertStore.compact): 4 experts at rows 0-3, the table says which
    table = torch.tensor([-3, 0, -1, -4, 1, -2], dtype=torch.int32)       # 0 -> row 2, 2 -> 0, 3 -> 3, 5 -> 1
    compacted = [h[:4].clone() for h in host]
    got_scratch = [torch.zeros(pairs, w, dtype=torch.int32) for w in widths]
    rows = staging.stage(idx, table, compacted, got_scratch)
    assert torch.equal(rows, staging.stage_reference(idx, table, compacted, want_scratch))
    for p, r in ((1, 2), (2, 1), (3, 0)):       # pairs of experts 0, 5, 2
        assert all(torch.equal(s[p], h[r]) for s, h in zip(got_scratch, compacted))
        assert all(torch.equal(s[p], w[p]) for s, w in zip(got_scratch, want_scratch))


@pytest.mark.parametrize("piece", (1 << 20, 100, 4096))
def test_staged_reads_land_each_expert_in_pieces_bit_for_bit(tmp_path, monkeypatch, piece):
    """From disk, the misses are read straight into their staging slots in pieces of up to PIECE
    bytes (a piece may span parts, a part may take several pieces; ragged sizes: 3-bit words, odd
    rows), all of them in flight at once: each slot holds what DiskHome.read gives, byte for byte.
    Where a part is held in another dtype than stored (f32 scales in a bf16 run), each miss is read
    whole and converted instead, with the same result as read()."""
    from concurrent.futures import ThreadPoolExecutor

    from kiln.ops.quant.reference import quantize
    from kiln.weights import experts
    from kiln.weights.experts import _empty_like_stack, _slot, read_staged

    monkeypatch.setattr(experts, "PIECE", piece)
    g = torch.Generator().manual_seed(3)
    stacks = {"l.gu": quantize(torch.randn(6, 38, 96, generator=g).to(torch.bfloat16), 3, 32),
              "l.dn": quantize(torch.randn(6, 96, 64, generator=g).to(torch.bfloat16), 4, 64)}
    home = disk_home(tmp_path / "layer.bin", stacks)
    home.open()
    pool = ThreadPoolExecutor(max_workers=3)
    for dtype in (torch.bfloat16, torch.float32):
        home.convert = lambda w, dtype=dtype: w._with(w.packed, w.scales.to(dtype), w.biases.to(dtype))
        staging = {n: _empty_like_stack(w, 4, "cpu") for n, w in home.read(0).items()}
        dest = {n: _slot(w, 0) for n, w in staging.items()}
        plan = home.reads(5, dest)
        assert (plan is None) == (dtype == torch.float32)
        if plan is not None:
            sizes = [sum(len(v) for v in views) for _, views in plan]
            assert max(sizes) <= piece and sum(sizes) == sum(p["nbytes"] for r in home.records.values()
                                                             for p in r["parts"].values())
        missing = [5, 0, 3, 2]
        read_staged(home, pool, staging, missing)
        for j, e in enumerate(missing):
            want = home.read(e)
            for n, w in staging.items():
                got = _slot(w, j)
                for a, b in ((got.packed, want[n].packed), (got.scales, want[n].scales),
                             (got.biases, want[n].biases)):
                    assert a.dtype == b.dtype
                    assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def test_a_staged_read_of_a_cut_file_is_a_one_line_error(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from kiln.ops.quant.reference import quantize
    from kiln.weights.experts import _empty_like_stack, read_staged

    g = torch.Generator().manual_seed(4)
    stacks = {"l.gu": quantize(torch.randn(4, 64, 64, generator=g).to(torch.bfloat16), 4, 64)}
    home = disk_home(tmp_path / "layer.bin", stacks)
    staging = {n: _empty_like_stack(w, 2, "cpu") for n, w in home.read(0).items()}
    os.truncate(tmp_path / "layer.bin", home.stride * 3 + 100)
    with pytest.raises(KilnError, match="expert 3 is cut short") as e:
        read_staged(home, ThreadPoolExecutor(max_workers=2), staging, [1, 3])
    assert "\n" not in str(e.value)


def test_static_keeps_at_most_SCRATCH_scratch_slots():
    """static's misses go through scratch slots beside its hot set: as many as the slots up to
    SCRATCH (a decode token's misses fit; the 397B's hot set of ~280 a layer does not double), a
    step's misses in batches of that many; the memory plan's arithmetic is the same."""
    from kiln.weights.experts import SCRATCH, MemoryPlan, SlotCache

    hot = list(range(0, 40, 2))                              # 20 hot experts of 64
    c = SlotCache(20, "static", hot)
    assert c.capacity == 20 + SCRATCH == 36 and SlotCache(3, "static", [1]).capacity == 6
    c.preload()
    needed = sorted(hot[:5] + list(range(1, 40, 2)))         # 5 hot, 20 misses
    batches = c.batches(needed)
    assert [sum(e not in c.slot_of for e in b) for b in batches] == [16, 4]
    for b in batches:
        where, loads = c.plan(b)
        assert all(20 <= s < 36 for _, s in loads) and all(where[e] == c.slot_of[e] for e in b if e in c.slot_of)
    for policy in ("static", "lfu"):
        plan = MemoryPlan(0, 0, 0, 0, expert=3, policy=policy)
        for room in range(0, 300):
            n = plan.slots_in(room)
            assert plan.slot_cost(n) <= room < plan.slot_cost(n + 1), (policy, room)


def test_a_compacted_store_resets_only_to_its_own_hot_set(packed, profile, resident):
    """Loaded static from host memory, the hot experts live in their slots only: a reset to static
    with the same profile runs again with the resident tokens; another policy is a one-line error."""
    prof = json.loads(Path(profile).read_text())
    llm = load(packed, expert_cache_slots=SLOTS, expert_policy="static", expert_profile=profile, expert_home="host")
    store = llm.model.expert_store
    assert store.kept and all(h.rows is not None for h in store.homes.values())
    store.reset("static", prof)
    logits, tokens = logits_and_tokens(llm)
    assert torch.equal(logits, resident[0]) and tokens == resident[1]
    with pytest.raises(KilnError, match="keeps the static policy's hot experts on the device only") as e:
        store.reset("lfu")
    assert "\n" not in str(e.value)


def test_the_pinned_arena_places_requests_without_rounding(monkeypatch):
    """PinnedArena: each request 4 KiB-aligned in the first chunk with room, chunks growing from FIRST
    to CHUNK (a request larger than that gets its own); no two requests overlap, each reads back what
    was copied in, and the chunks hold the requests with little to spare (torch's pinned allocator
    would round each up to a power of two)."""
    from kiln.ops.quant.reference import quantize
    from kiln.weights.experts import PinnedArena

    monkeypatch.setattr(PinnedArena, "FIRST", 1 << 16)
    monkeypatch.setattr(PinnedArena, "CHUNK", 1 << 18)
    arena, g = PinnedArena(), torch.Generator().manual_seed(5)
    made = []
    for k in range(40):
        n = int(torch.randint(1, 30_000, (1,), generator=g))
        src = torch.randn(n, generator=g).to(torch.bfloat16 if k % 2 else torch.float32)
        made.append((src, arena.copy(src)))
    big = torch.randn(300_000, generator=g)
    made.append((big, arena.copy(big)))                 # past CHUNK: a chunk of its own
    q = quantize(torch.randn(4, 32, 64, generator=g).to(torch.bfloat16), 4, 64)
    qa = arena.copy(q)
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for _, t in made)
    spans += [(t.data_ptr(), t.data_ptr() + t.nbytes) for t in (qa.packed, qa.scales, qa.biases)]
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    bases = [c[0].data_ptr() for c in arena.chunks]       # (pinned memory is page-aligned; here, malloc's)
    assert all(any(0 <= p - c < 1 << 22 and (p - c) % 4096 == 0 for c in bases) for p, _ in spans)
    assert all(torch.equal(s, t) for s, t in made)
    assert torch.equal(qa.packed, q.packed) and torch.equal(qa.scales, q.scales) and qa.bits == 4
    used = sum(-(-(e - b) // 4096) * 4096 for b, e in spans)
    assert arena.nbytes < used + 3 * (1 << 18)      # at most about a chunk's tail lost a chunk


def test_a_static_hot_set_of_every_expert_leaves_the_host_stacks_whole():
    """Static with as many slots as experts and a profile naming them all: every expert lives in a
    slot, nothing is cut from the host stacks (an empty stack would break the per-expert sizes), and
    the experts' outputs are the resident ones."""
    from kiln.backends.reference import ReferenceOps
    from kiln.ops.quant.reference import quantize
    from kiln.weights.experts import ExpertStore, HostHome

    e, h, i, dt = 4, 64, 64, torch.float32
    g = torch.Generator().manual_seed(2)
    gate_up = quantize(torch.randn(e, 2 * i, h, generator=g).to(dt) * h ** -0.5, 4, 64)
    down = quantize(torch.randn(e, h, i, generator=g).to(dt) * i ** -0.5, 4, 64)
    home = HostHome({"l.gu": gate_up, "l.dn": down})
    store = ExpertStore({"l.": home}, "cpu", "static", e, profile={"l.": {str(x): 1 for x in range(e)}})
    store.compact("l.")
    assert home.rows is None and home.stacks["l.gu"].packed.shape[0] == e and home.nbytes() > 0
    gu_h, dn_h = store.handle("l.", "l.gu", gate_up.shape), store.handle("l.", "l.dn", down.shape)
    ops = ReferenceOps(torch.device("cpu"))
    x, idx, w = torch.randn(3, h, generator=g), torch.tensor([[0, 1], [2, 3], [1, 2]]), torch.rand(3, 2, generator=g)
    got = ops.moe_experts(x, idx, w, gu_h, dn_h, "silu")
    assert torch.equal(got, ops.moe_experts(x, idx, w, gate_up, down, "silu"))
    assert store.stats["l."].misses == 0
