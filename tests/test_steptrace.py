"""KILN_TRACE: a batch's host-side events written as JSON lines, in the order they happened."""

from __future__ import annotations

import kiln
from kiln import steptrace
from kiln.sampling import SamplingParams


def test_a_traced_batch_logs_its_slots_prefills_and_steps_in_order(tmp_path, monkeypatch):
    from kiln.engine import Batch
    path = tmp_path / "trace.jsonl"
    monkeypatch.setattr(steptrace, "PATH", str(path))
    monkeypatch.setattr(steptrace, "_file", None)
    llm = kiln.load("synth:tiny-qwen3.5", device="cpu", backend="cuda", dtype="f32")
    eng = llm.engine
    eng.prefill_chunk = 8
    batch = Batch(eng, set(llm.eos_ids), slots=2, interleave=True)
    a = batch.add([3, 1, 4, 1, 5], SamplingParams(max_new_tokens=6, ignore_eos=True))
    batch.step()
    b = batch.add(list(range(10, 30)), SamplingParams(max_new_tokens=3, ignore_eos=True))
    c = batch.add([2, 7, 1, 8], SamplingParams(max_new_tokens=3, ignore_eos=True))
    steps = 1
    batch.cancel(c)
    while not (a.done and b.done):
        batch.step()
        steps += 1
    steptrace._file.close()
    events = steptrace.read(str(path))
    kinds = [e["e"] for e in events]
    assert kinds.count("step") == steps
    assert [e["r"] for e in events if e["e"] == "cancel"] == [c.serial]
    slot = {}
    for e in events:            # each request: taken, prefilled on its slot, released from it
        if e["e"] == "take":
            slot[e["r"]] = e["slot"]
        elif e["e"] == "prefill":
            assert all(slot[r] == s and 0 <= start < end for r, s, start, end in e["parts"])
        elif e["e"] == "release":
            assert slot.pop(e["r"]) == e["slot"]
    assert slot == {}
    taken = {e["r"] for e in events if e["e"] == "take"}
    assert taken == {a.serial, b.serial}             # c was cancelled before it took a slot
    ends = [e for e in events if e["e"] == "prefill"]
    assert sum(end - start for e in ends for r, _, start, end in e["parts"] if r == b.serial) == 20
    launches = [e for e in events if e["e"] == "launch"]
    assert any(e["inside"] for e in launches)        # b's chunks ran a's steps between their layers
    assert all(e["rows"] == len(e["slots"]) for e in launches)
    assert [e["t"] for e in events] == sorted(e["t"] for e in events)


def test_off_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(steptrace, "PATH", None)
    monkeypatch.chdir(tmp_path)
    steptrace.event("step", running=0)
    assert list(tmp_path.iterdir()) == []
