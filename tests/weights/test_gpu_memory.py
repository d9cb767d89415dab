"""The device memory budget (kiln.load's gpu_memory, `--gpu-memory`; docs/streaming.md): on the CPU
the budget is the device's memory, so the arithmetic runs here. Each expected figure is computed
from what a resident load of the same tiny packed MoE actually holds (its weights' bytes, a state
grown to the max context), not by kiln's own sizing: the plan's slots equal what those figures
leave room for, the streamed tokens equal the resident ones, a budget below the core is a one-line
error, a budget above the model loads it resident, and automatic streaming decides from the free
memory it is given."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import kiln
from kiln.api import free_memory, memory_plan, pick_dtype
from kiln.backends import get_ops
from kiln.cli import main as cli_main
from kiln.errors import KilnError
from kiln.weights import open_checkpoint
from kiln.weights.experts import auto_budget
from tests.weights import test_experts as streaming  # its helpers (a module: its tests are not collected twice)

PROMPT = streaming.PROMPT
CONTEXT = 48            # the max context every load here runs with (the KV cache is sized for it)
STACKS = ("experts.gate_up_proj", "experts.down_proj")
GB = 1e9


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    return streaming.pack_tiny_moe(tmp_path_factory.mktemp("budget"))


def load(path, **kw):
    return kiln.load(str(path), device="cpu", backend="reference", dtype="f32", max_context=CONTEXT, **kw)


def run(llm):
    """The prompt's last logits and six greedy decode steps' (the streaming tests' helper); the tokens."""
    return streaming.logits_and_tokens(llm, 6)


@pytest.fixture(scope="module")
def measured(packed) -> dict:
    """What the resident model holds: the core's bytes, one expert's of each layer, the state's at the
    max context; the workspace by the documented rule from its (merged) weights; its logits, tokens."""
    llm = load(packed)
    w, cfg = llm.model.w, llm.model.cfg
    experts = {n: x for n, x in w.items() if n.endswith(STACKS)}
    state = llm.engine.new_state(CONTEXT)
    llm.engine.prefill([i % 300 + 1 for i in range(CONTEXT - 1)], state)
    llm.engine.decode_step(1, CONTEXT - 1, state)       # the last position: the cache as large as it grows
    cache = sum(t.nbytes for layer in state for t in vars(layer).values() if isinstance(t, torch.Tensor))
    widest = max(x.shape[1] * cfg.num_experts_per_tok if n in experts else x.shape[0]
                 for n, x in w.items() if len(x.shape) >= 2 and "embed" not in n and n != "lm_head.weight")
    chunk = min(llm.model.ops.prefill_chunk, CONTEXT)
    return {"core": sum(x.nbytes for n, x in w.items() if n not in experts),
            "expert": sum(x.nbytes // x.shape[0] for x in experts.values()),
            "experts": sum(x.nbytes for x in experts.values()), "count": cfg.num_experts,
            "cache": cache, "workspace": (256 << 20) + chunk * 4 * (6 * cfg.hidden_size + 2 * widest),
            "run": run(llm)}


def need(m: dict) -> int:
    return m["core"] + m["cache"] + m["workspace"]


def test_the_budget_holds_the_slots_its_arithmetic_gives_and_the_tokens_are_the_resident_ones(packed, measured):
    gb = (need(measured) + 3.5 * measured["expert"]) / GB        # room for 3 slots a layer, not 4
    llm = load(packed, gpu_memory=gb)
    plan = llm.memory
    assert (plan.core, plan.cache, plan.workspace) == (measured["core"], measured["cache"], measured["workspace"])
    assert plan.expert == measured["expert"] and plan.slots == 3
    assert llm.model.expert_store.slots == 3 and llm.model.expert_store.policy == "lfu"
    logits, tokens = run(llm)
    assert torch.equal(logits, measured["run"][0]) and tokens == measured["run"][1]
    # the static policy keeps as many scratch slots again: the same budget holds 1 a layer
    assert memory_plan_for(packed, gb, policy="static").slots == 1


@pytest.mark.parametrize("source", ("hf", "synth:tiny-qwen3.5-moe-p2:bits=4"))
def test_the_weights_are_sized_as_a_resident_load_holds_them(packed, source):
    """Other readers than the manifest: safetensors' spans (bf16 stored, f32 held), a quantised draw."""
    path = packed.parent / "hf" if source == "hf" else source
    w = load(path).model.w
    plan = memory_plan_for(path, 100.0)
    assert plan.core == sum(x.nbytes for n, x in w.items() if not n.endswith(STACKS))
    assert plan.experts == sum(x.nbytes for n, x in w.items() if n.endswith(STACKS))


def memory_plan_for(path, gb, slots=None, policy=None, free=None):
    """memory_plan as kiln.load calls it (reference backend, f32, CONTEXT), without loading weights."""
    ckpt = open_checkpoint(path)
    ops = get_ops("reference", torch.device("cpu"))
    return memory_plan(ckpt, ops, pick_dtype("f32", torch.device("cpu")), CONTEXT, gb, slots, policy, free)


def test_a_budget_that_holds_every_expert_loads_them_resident(packed, measured, capsys):
    gb = (need(measured) + measured["experts"]) / GB
    llm = kiln.load(str(packed), device="cpu", backend="reference", dtype="f32", max_context=CONTEXT,
                    gpu_memory=gb, quiet=False)
    assert llm.memory.slots is None and llm.model.expert_store is None
    assert "every expert resident" in capsys.readouterr().err
    assert memory_plan_for(packed, gb - 1e-9).slots == measured["count"] - 1       # a byte less: streamed


def test_explicit_slots_win_if_they_fit(packed, measured):
    gb = (need(measured) + 3.5 * measured["expert"]) / GB
    assert memory_plan_for(packed, gb, slots=2).slots == 2
    with pytest.raises(KilnError, match="--expert-cache-slots 4 needs .* 3 slots a layer fit") as e:
        memory_plan_for(packed, gb, slots=4)
    assert "\n" not in str(e.value)


def test_a_budget_below_the_core_is_a_one_line_error(packed, measured, capsys):
    gb = (measured["core"] + measured["cache"]) / GB
    with pytest.raises(KilnError, match="too small: the core .* need") as e:
        memory_plan_for(packed, gb)
    assert "\n" not in str(e.value)
    ids = ",".join(map(str, PROMPT))
    assert cli_main(["run", str(packed), "--device", "cpu", "--backend", "reference", "--dtype", "f32",
                     "--max-context", str(CONTEXT), "--prompt-ids", ids, "--gpu-memory", f"{gb:.6f}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "too small" in err and "Traceback" not in err
    with pytest.raises(KilnError, match="less than one expert slot"):      # the core fits, no slot does
        memory_plan_for(packed, (need(measured) + measured["expert"] // 2) / GB)


def test_a_dense_model_fits_or_is_the_same_error():
    spec = "synth:tiny-llama"
    with pytest.raises(KilnError, match="too small: the core"):
        kiln.load(spec, device="cpu", backend="reference", dtype="f32", max_context=CONTEXT, gpu_memory=0.01)
    llm = kiln.load(spec, device="cpu", backend="reference", dtype="f32", max_context=CONTEXT, gpu_memory=1)
    assert llm.memory.count == 0 and "dense model" in llm.memory.line()


def test_automatic_streaming_decides_from_the_free_memory_it_is_given(packed, measured):
    whole = need(measured) + measured["experts"]
    margin = lambda budget: (budget + (1 << 30)) / 0.95      # noqa: E731  the free memory auto_budget leaves `budget` of
    assert free_memory(torch.device("cpu")) is None          # never automatic on the CPU
    assert memory_plan_for(packed, None, free=None) is None
    assert memory_plan_for(packed, None, free=int(margin(whole)) + 64) is None           # a resident load fits
    plan = memory_plan_for(packed, None, free=int(margin(need(measured) + 3.5 * measured["expert"])))
    assert plan.auto and plan.slots == 3 and "streaming the routed experts, 3 slots a layer of 8" in plan.line()
    assert abs(auto_budget(10 ** 11) - (10 ** 11 - (1 << 30) - 5 * 10 ** 9)) <= 1
    with pytest.raises(KilnError, match="free device memory less a margin"):
        memory_plan_for(packed, None, free=int(margin(need(measured) - 1)))


def test_the_cli_prints_the_plan_and_the_bench_json_carries_the_budget(packed, measured, tmp_path, capsys):
    gb = f"{(need(measured) + 3.5 * measured['expert']) / GB:.9f}"
    out = tmp_path / "b.json"
    assert cli_main(["bench", str(packed), "--device", "cpu", "--backend", "reference", "--dtype", "f32",
                     "--max-context", str(CONTEXT), "--prompt-lengths", "16", "--gen", "2", "--runs", "1",
                     "--gpu-memory", gb, "--json", str(out)]) == 0
    assert "[kiln] --gpu-memory" in capsys.readouterr().err
    s = json.loads(out.read_text())["expert_store"]
    assert s["slots"] == 3 and s["gpu_memory"]["slots"] == 3 and s["gpu_memory"]["gb"] == round(float(gb), 6)
    assert s["gpu_memory"]["core_bytes"] == measured["core"]


def _pool_bytes(pool) -> int:
    """What a slot pool holds, counted from its tensors' storage (each pooled tensor once; not the block
    table, 4 bytes a page of a slot's row, which the plan leaves out)."""
    seen = {}
    for layer in pool.states[0]:
        for name, t in vars(layer).items():
            if isinstance(t, torch.Tensor) and name != "table":
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def test_a_budget_sizes_the_batch_pool_and_says_how_many_requests_it_allows(capsys):
    """--gpu-memory with --max-batch on the cuda backend (its batched steps pool the requests' state):
    the budget holds the pool too. Requests take KV pages as they grow, so the pool is --max-batch
    slots of fixed state (the GDN states) and the pages that fit, up to every slot's max context;
    slots past what fits beside one max-context request's pages are cut, and the load says how many
    concurrent requests that is; below one slot and its pages, a one-line error."""
    from kiln.cache import PAGE, SlotPool, pages_for
    spec, context = "synth:tiny-qwen3.5", 512

    def load_with(gb, batch=64):
        return kiln.load(spec, device="cpu", backend="cuda", dtype="f32", max_context=context, gpu_memory=gb,
                         max_batch=batch, quiet=False)

    roomy = load_with(1.0)
    template = roomy.model.make_state(torch.float32, "cpu")
    fixed, page = SlotPool.ring_bytes(template, context), SlotPool.page_bytes(template, context)
    spare, full = SlotPool.bytes_per_slot(template, context, rings=False), pages_for(context)
    assert fixed > 0 and page > 0 and full * PAGE == context
    plan = roomy.memory
    assert plan.batch == 64 and plan.batch_context == context and plan.batch_pages == 64 * full
    assert plan.pool == 64 * fixed + 64 * full * page + spare
    rest = plan.need - plan.pool                          # the core, cache and workspace
    tight = load_with((rest + spare + 64 * fixed + 6 * page + page // 2) / GB)   # 64 slots, 6 pages
    assert tight.memory.batch == 64 and tight.memory.batch_pages == 6
    assert "64 concurrent requests, KV pages for 1 of them at the full 512 tokens" in tight.memory.line()
    capsys.readouterr()
    pool = tight.engine.slot_pool(64)
    assert pool.count == 64 and pool.pages == 6 and pool.capacity == context
    assert _pool_bytes(pool) == tight.memory.pool
    assert "batch state: 64 slots of up to 512 tokens each, KV in 6 pages" in capsys.readouterr().err
    few = load_with((rest + spare + 5 * fixed + full * page + fixed // 2) / GB)   # 5 slots beside a full request
    assert few.memory.batch == 5 and few.memory.batch_pages == full
    prompts = [[3, 1, 4], [1, 5, 9, 2], [6, 5], [3, 5, 8, 9, 7], [9, 3], [2, 3, 8, 4]]
    first = [few.generate(p, max_new_tokens=1).token_ids for p in prompts]       # each prompt's own prefill
    got = [c.token_ids for c in few.generate(prompts, max_new_tokens=3, ignore_eos=True)]  # 6 requests, 5 slots
    assert [t[:1] for t in got] == first and all(len(t) == 3 for t in got)
    with pytest.raises(KilnError, match="not two batch slots of 512 tokens") as e:
        load_with((rest + spare + fixed + full * page - 1) / GB)
    assert "\n" not in str(e.value)
    assert load_with((rest + spare) / GB, batch=1).memory.batch == 0     # no batch: no pool planned


def test_a_budget_keeps_the_experts_before_the_batch_pool(packed, measured):
    """An MoE under --gpu-memory with --max-batch: every expert resident where they fit beside the
    whole pool; else the experts keep their slots (as asked, else up to 16 a layer) and the pool
    takes what is left (streamed, with no prefill graph's rows in the workspace: those graphs do not
    run beside streamed experts); where not even the experts' slots fit, the experts' own error."""
    ckpt, ops, dtype = open_checkpoint(packed), get_ops("cuda", torch.device("cpu")), torch.float32

    def plan(gb, slots=None):
        return memory_plan(ckpt, ops, dtype, CONTEXT, gb, slots, None, None, 8)

    roomy = plan(10.0)
    fixed, page, spare = roomy.batch_slot, roomy.batch_page, roomy.batch_spare
    one = fixed + page                                               # a slot at the max context (48: a page)
    assert roomy.slots is None and roomy.batch == 8 and roomy.batch_pages == 8 and roomy.pool == 8 * one + spare
    rest, experts = roomy.need - roomy.pool, roomy.experts
    assert roomy.count == 8 and experts == 8 * roomy.per_slot        # 8 experts a layer: min(16, 8) kept
    tight = plan((rest + experts + spare + 3 * one + one // 2) / GB)   # the whole pool does not fit beside them
    assert tight.slots is None and tight.batch == 8                  # the experts first, then 8 slots
    assert tight.batch_pages == (3 * one + one // 2 - 8 * fixed) // page < 8    # and the pages left
    graph_rows = measured["workspace"] - (256 << 20)                 # the prefill graphs' 48 rows (chunk 48)
    asked = plan((rest - graph_rows + 2 * roomy.per_slot + spare + 6 * one + one // 2) / GB, slots=2)
    assert asked.slots == 2 and asked.batch == 8                     # the 2 slots asked, then the pool
    assert asked.workspace == roomy.workspace - graph_rows
    assert asked.batch_pages == (6 * one + one // 2 - 8 * fixed) // page
    with pytest.raises(KilnError, match="less than one expert slot"):
        plan((rest + roomy.per_slot // 2) / GB)


def test_a_streamed_model_halves_its_prefill_chunk_until_its_slots_fit(packed, measured):
    """A tight budget on a streamed model: the prefill chunk (4,096 here, the cuda backend's) halves
    while the slots a layer asked for do not fit beside its activations, down to 512; no prefill
    graph's rows are held (they do not run beside streamed experts); a budget that holds every expert
    with the graphs at a smaller chunk loads them resident at that chunk. Workspace by the documented
    rule: 256 MiB and a chunk's rows (each as the measured plan's 48 rows)."""
    ckpt, dtype, limit = open_checkpoint(packed), torch.float32, 4096
    ops = get_ops("cuda", torch.device("cpu"))
    ops.prefill_chunk = 4096
    row = (measured["workspace"] - (256 << 20)) // CONTEXT

    def plan(gb, slots=None):
        return memory_plan(ckpt, ops, dtype, limit, gb, slots, None, None)

    roomy = plan(10.0, slots=3)
    staging = roomy.workspace - (256 << 20) - 4096 * row          # zero-copy's scratch, the same at any chunk
    assert roomy.chunk == 4096 and roomy.slots == 3 and staging >= 0     # streamed: no graph rows held
    core, cache, per = roomy.core, roomy.cache, roomy.per_slot

    def need(chunk, graphs=False):
        return core + cache + (256 << 20) + (chunk + (min(chunk, 2048) if graphs else 0)) * row + staging

    tight = plan((need(1024) + 3.5 * per) / GB, slots=3)
    assert (tight.chunk, tight.slots, tight.workspace) == (1024, 3, need(1024) - core - cache)
    floor = plan((need(512) + 1.5 * per) / GB, slots=1)             # 1 slot fits only at the floor
    assert (floor.chunk, floor.slots) == (512, 1)
    with pytest.raises(KilnError, match="--expert-cache-slots 3"):
        plan((need(512) + 2.5 * per) / GB, slots=3)                 # not even at 512: the slots' error
    resident = plan((need(2048, graphs=True) + measured["experts"]) / GB)
    assert (resident.chunk, resident.slots) == (2048, None)        # resident, its prefill graphs' rows held
    assert resident.workspace == need(2048, graphs=True) - core - cache


def test_the_engine_prefills_in_the_budgets_chunk_with_the_resident_tokens(packed, monkeypatch, capsys):
    """End to end (the reference backend's 48-token chunk at this context, halved to powers of two:
    32, 16, 8, the floor lowered to 8): the load takes the plan's chunk, says it, and a prompt longer
    than the chunk gives the tokens of a resident load prefilling in the same chunks."""
    import kiln.api
    monkeypatch.setattr(kiln.api, "STREAM_CHUNK_MIN", 8)
    roomy = load(packed, gpu_memory=10.0, expert_cache_slots=3)
    assert roomy.memory.chunk == CONTEXT and roomy.engine.prefill_chunk == 512     # (the engine caps it at 48)
    base = roomy.memory.need - roomy.memory.workspace + (256 << 20)
    per_row = (roomy.memory.workspace - (256 << 20)) // CONTEXT     # (no staging on the reference backend)
    gb = (base + 8 * per_row + 3.5 * roomy.memory.per_slot) / GB   # 3 slots fit at a chunk of 8, not 16
    llm = load(packed, gpu_memory=gb, expert_cache_slots=3, quiet=False)
    assert llm.memory.chunk == 8 and llm.engine.prefill_chunk == 8 and llm.memory.slots == 3
    assert "(prefill chunks of 8 tokens)" in capsys.readouterr().err
    assert len(PROMPT) > 8
    resident = load(packed)
    resident.engine.prefill_chunk = 8
    logits, tokens = run(llm)
    want_logits, want_tokens = run(resident)
    assert torch.equal(logits, want_logits) and tokens == want_tokens


def test_the_cuda_plan_counts_the_dense_copies_of_quantised_routers():
    """On the cuda backend a quantised router or shared-expert gate is also kept dense (the fused
    router and combine read it): its core is the reference's plus each such weight's 16-bit bytes."""
    spec = "synth:tiny-qwen3.5-moe-p2:bits=4:group=32:router=8"
    ckpt, dtype = open_checkpoint(spec), torch.bfloat16
    cuda = memory_plan(ckpt, get_ops("cuda", torch.device("cpu")), dtype, CONTEXT, 10.0, 2)
    ref = memory_plan(ckpt, get_ops("reference", torch.device("cpu")), dtype, CONTEXT, 10.0, 2)
    w = kiln.load(spec, device="cpu", backend="reference", dtype="bf16").model.w
    routers = [n for n in w if n.endswith(("mlp.gate.weight", "shared_expert_gate.weight"))]
    assert routers and all(hasattr(w[n], "bits") for n in routers)
    assert cuda.core - ref.core == sum(w[n].shape[0] * w[n].shape[1] * 2 for n in routers)


def test_a_budget_past_the_gpus_free_memory_is_a_one_line_error(monkeypatch, capsys):
    """--gpu-memory above what the device has free fails at once, not as an out-of-memory error after
    minutes of weights (the free memory is faked: the check runs wherever a device reports it)."""
    monkeypatch.setattr("kiln.api.free_memory", lambda dev: int(2.5 * GB))
    with pytest.raises(KilnError, match=r"--gpu-memory 3 GB: the GPU has 2\.5 GB free") as e:
        kiln.load("synth:tiny-llama", device="cpu", backend="reference", dtype="f32", max_context=CONTEXT,
                  gpu_memory=3)
    assert "\n" not in str(e.value)
    llm = kiln.load("synth:tiny-llama", device="cpu", backend="reference", dtype="f32", max_context=CONTEXT,
                    gpu_memory=2)
    assert llm.memory is not None
