"""Damaged and hostile GGUF files: the reader (kiln/weights/gguf_file.py, then open_gguf's config)
refuses each with one KilnError line naming the file, and lets no other exception out.

Each bundled model's header is damaged 500 ways: random overwrites (the issue's 3,000 bytes at
offset 200 among them), truncations, each count, length, type and offset field set to hostile
values (0, 2^64 - 1, 2^63, one more, twice as many, ...), and types no GGUF has. A variant is a
sparse copy: the damaged header, then the file's size with zeros where the tensor data was (the
reader never looks at the data, only at where it lies)."""

from __future__ import annotations

import random
import struct

import pytest

from kiln import hub
from kiln.errors import KilnError
from kiln.weights import open_checkpoint

MODELS = ["smollm2-135m", "gemma3-270m"]
VARIANTS = 500
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}   # GGUF scalar type -> bytes


def _fields(buf: bytes) -> tuple[list[tuple[int, int, str]], int]:
    """(offset, size, what) of every count, length, type and offset field of the header (a sample of
    a vocabulary's string lengths), and where the header ends. A walk of the format written for this
    test, on undamaged files only."""
    u32 = lambda at: struct.unpack_from("<I", buf, at)[0]  # noqa: E731
    u64 = lambda at: struct.unpack_from("<Q", buf, at)[0]  # noqa: E731
    out = [(4, 4, "version"), (8, 8, "tensor count"), (16, 8, "metadata count")]
    n_tensors, n_kv, pos = u64(8), u64(16), 24
    for _ in range(n_kv):
        out.append((pos, 8, "key length"))
        pos += 8 + u64(pos)
        out.append((pos, 4, "value type"))
        vtype, pos = u32(pos), pos + 4
        if vtype == 8:
            out.append((pos, 8, "string length"))
            pos += 8 + u64(pos)
        elif vtype == 9:
            out += [(pos, 4, "array type"), (pos + 4, 8, "array length")]
            etype, count, pos = u32(pos), u64(pos + 4), pos + 12
            if etype != 8:
                pos += count * _SIZES[etype]
                continue
            for i in range(count):
                if i < 3 or i % 997 == 0:
                    out.append((pos, 8, "array string length"))
                pos += 8 + u64(pos)
        else:
            pos += _SIZES[vtype]
    for _ in range(n_tensors):
        out.append((pos, 8, "tensor name length"))
        pos += 8 + u64(pos)
        out.append((pos, 4, "dimension count"))
        n_dims, pos = u32(pos), pos + 4
        out += [(pos + 8 * d, 8, "dimension") for d in range(n_dims)]
        pos += 8 * n_dims
        out += [(pos, 4, "tensor type"), (pos + 4, 8, "tensor offset")]
        pos += 12
    return out, pos


def _hostile(value: int, size: int, rng: random.Random) -> int:
    top = (1 << (8 * size)) - 1
    picks = [0, 1, top, top - 1, 1 << (8 * size - 1), value + 1, value - 1, value * 2, value + 4096,
             rng.randrange(top + 1)]
    if size == 8:
        picks += [1 << 32, (1 << 63) - 1, 1 << 62, 1 << 40]
    return rng.choice(picks) & top


def _variants(data: bytes, seed: int):
    """(what was done, damaged header bytes or None, file size) for VARIANTS damaged files."""
    rng = random.Random(seed)
    fields, end = _fields(data)
    head = data[:end + 64]
    types = [f for f in fields if "type" in f[2]]

    def overwrite(at: int, new: bytes) -> bytes:
        return head[:at] + new + head[at + len(new):]

    yield "3,000 random bytes at offset 200", overwrite(200, rng.randbytes(3000)), len(data)
    for i in range(VARIANTS - 1):
        kind = i % 5
        if kind == 0:           # random bytes somewhere in the header
            n = rng.choice([1, 2, 4, 8, 16, 64, 3000])
            at = rng.randrange(len(head))
            yield f"{n} random bytes at {at}", overwrite(at, rng.randbytes(n)), len(data)
        elif kind == 1:         # cut short, in the header or in the tensor data
            n = rng.randrange(len(head)) if rng.random() < 0.7 else rng.randrange(len(head), len(data))
            yield f"truncated to {n} bytes", None, n
        elif kind in (2, 3):    # a count, length, type or offset made hostile
            at, size, what = rng.choice(fields)
            old = int.from_bytes(head[at:at + size], "little")
            new = _hostile(old, size, rng)
            yield f"{what} at {at}: {old} -> {new}", overwrite(at, new.to_bytes(size, "little")), len(data)
        else:                   # a type no GGUF (or ggml) has
            at, size, what = rng.choice(types)
            new = rng.choice([13, 14, 255, 1000, 2**31, 2**32 - 1, 4, 5])
            yield f"{what} at {at} -> {new}", overwrite(at, new.to_bytes(size, "little")), len(data)


def _write(path, data: bytes, head: bytes | None, size: int) -> None:
    with open(path, "wb") as f:
        if head is None:            # a truncation
            f.write(data[:min(size, 8 << 20)])
        else:
            f.write(head)
        f.truncate(size)            # sparse: zeros where the tensor data was


@pytest.mark.parametrize("name", MODELS)
def test_every_damaged_variant_is_one_clear_error(name, tmp_path):
    src = hub.ensure(name)
    with open(src, "rb") as f:
        data = f.read(8 << 20)      # the header is under 8 MiB in both; the rest is tensor data
    size = src.stat().st_size
    path = tmp_path / "damaged.gguf"
    refused, loaded = 0, 0
    for what, head, n in _variants(data, seed=MODELS.index(name)):
        _write(path, data, head, min(n, size) if head is None else size)
        try:
            open_checkpoint(path)
            loaded += 1             # damage the reader cannot see (a name's letters, a float's value)
        except KilnError as e:
            msg = str(e)
            assert "\n" not in msg and str(path) in msg, (what, msg)
            refused += 1
        except Exception as e:      # noqa: BLE001  (the point: nothing else may escape)
            pytest.fail(f"{name}, {what}: {type(e).__name__}: {e}")
    assert refused + loaded == VARIANTS
    assert refused > VARIANTS // 2, (refused, loaded)   # most damage is seen: the variants do damage


def test_the_issues_example_is_refused(tmp_path):
    """3,000 bytes at offset 200 of SmolLM2 crashed with KeyError: 2449473544 (the value-type table)."""
    src = hub.ensure("smollm2-135m")
    with open(src, "rb") as f:
        head = f.read(1 << 20)
    head = head[:200] + random.Random(0).randbytes(3000) + head[3200:]
    path = tmp_path / "garbled.gguf"
    _write(path, b"", head, src.stat().st_size)
    with pytest.raises(KilnError, match=r"not a valid GGUF file \(.+\)$"):
        open_checkpoint(path)
