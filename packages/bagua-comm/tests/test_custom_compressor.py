"""The README's "write your own" compressor, run as written through compressed_allreduce on
2 gloo ranks, against a numpy reference of cast-to-float16, reduce, cast again."""

import re
from pathlib import Path

import numpy as np
import pytest
import torch

import bagua_comm as bc
from bagua_comm.compression import Compressor, MinMaxUInt8
from bagua_comm.testing import run_ranks

README = Path(__file__).resolve().parents[1] / "README.md"
WORLD = 2


def readme_compressor():
    """The ``Float16`` class exactly as the README's "Write your own compressor" shows it."""
    text = README.read_text()
    section = text.split("## Write your own compressor", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    code = next(b for b in blocks if "class Float16(Compressor)" in b)
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    return namespace["Float16"]


def _x(rank, numel, dtype):
    g = torch.Generator().manual_seed(5 + rank)
    return (torch.randn(numel, generator=g) * 1000 * (rank + 1)).to(dtype)


def _reference(inputs, op):
    """Every rank's input cast to float16, reduced in float32, cast to float16 again."""
    parts = [x.float().numpy().astype(np.float16).astype(np.float32) for x in inputs]
    if op == "max":
        reduced = np.maximum.reduce(parts)
    else:
        reduced = parts[0].copy()
        for p in parts[1:]:
            reduced = reduced + p
        if op == "avg":
            reduced = reduced / np.float32(len(parts))
    return reduced.astype(np.float16).astype(np.float32)


CASES = [("avg f32 padded", 1001, torch.float32, "avg", 2),
         ("sum f32 4 chunks", 64, torch.float32, "sum", 4),
         ("max bf16", 300, torch.bfloat16, "max", 2),
         ("sum f16", 257, torch.float16, "sum", 2)]
OPS = {"avg": bc.ReduceOp.AVG, "sum": bc.ReduceOp.SUM, "max": bc.ReduceOp.MAX}


def _ranks_main():
    Float16 = readme_compressor()

    class Float16By8(Float16):
        """Needs 8 elements per chunk (as a bit-packing compressor would)."""

        def alignment(self, chunks):
            return 8 * chunks

        def compress(self, tensor, **kw):
            chunks = kw.get("chunks") or self.chunks
            assert tensor.numel() % self.alignment(chunks) == 0, tensor.numel()
            return super().compress(tensor, **kw)

    r = bc.get_rank()
    res = {}
    for name, numel, dtype, op, chunks in CASES:
        x = _x(r, numel, dtype)
        y = torch.full_like(x, float("nan"))
        bc.compressed_allreduce(x, y, op=OPS[op], compressor=Float16(chunks))
        res[name] = y.float().numpy()
    x = _x(r, 1001, torch.float32)
    bc.compressed_allreduce(x, x, compressor=Float16By8(2), key="aligned", async_op=True).wait()
    res["aligned in place"] = x.numpy()

    class Overlong(Float16):
        """Breaks its own contract: 32 bytes more than payload_numel() said."""

        def compress(self, tensor, **kw):
            kw.pop("out", None)
            return torch.cat([super().compress(tensor, **kw), torch.zeros(32, dtype=torch.uint8)])

    try:
        bc.compressed_allreduce(x, torch.empty_like(x), compressor=Overlong(2))
        res["overlong"] = None
    except ValueError as err:
        res["overlong"] = str(err)
    t = torch.ones(2)
    bc.allreduce_inplace(t)                       # the group still works afterwards
    res["after"] = t.tolist()
    return res


@pytest.mark.timeout(300)
def test_readme_compressor_through_compressed_allreduce():
    results = run_ranks(_ranks_main, WORLD, timeout=240)
    for name, numel, dtype, op, _chunks in CASES:
        want = _reference([_x(r, numel, dtype) for r in range(WORLD)], op)
        want = torch.from_numpy(want).to(dtype).float().numpy()
        for r in range(WORLD):
            np.testing.assert_array_equal(results[r][name], want, err_msg=f"{name} rank {r}")
    want = _reference([_x(r, 1001, torch.float32) for r in range(WORLD)], "avg")
    for r in range(WORLD):
        np.testing.assert_array_equal(results[r]["aligned in place"], want)
        msg = results[r]["overlong"]
        assert msg is not None and "Overlong.compress()" in msg, msg
        assert "payload_numel() promised a uint8 tensor of" in msg
        assert results[r]["after"] == [2.0, 2.0]


def test_readme_compressor_roundtrip_and_out():
    Float16 = readme_compressor()
    c = Float16(chunks=2)
    assert isinstance(c, Compressor)
    assert c.alignment(2) == 2 and c.state_dict() == {}
    x = torch.randn(10, dtype=torch.float32)
    assert c.payload_numel(10) == 20
    buf = torch.empty(20, dtype=torch.uint8)
    payload = c.compress(x, out=buf)
    assert payload.data_ptr() == buf.data_ptr() and payload.dtype == torch.uint8
    out = c.decompress(payload, torch.empty(10))
    np.testing.assert_array_equal(out.numpy(), x.numpy().astype(np.float16).astype(np.float32))


def test_alignment_default_and_minmax():
    assert MinMaxUInt8(4).alignment(4) == 4
    assert MinMaxUInt8(4).alignment(2) == 2
    with pytest.raises(ValueError, match="chunks"):
        MinMaxUInt8(4).alignment(0)


def test_bad_alignment_raises_before_communication():
    results = run_ranks(_bad_main, 1, timeout=120)
    assert "alignment(2) must return a positive multiple of 2" in results[0]


def _bad_main():
    Float16 = readme_compressor()

    class Bad(Float16):
        def alignment(self, chunks):
            return chunks + 1

    try:
        bc.compressed_allreduce(torch.ones(4), torch.ones(4), compressor=Bad(2))
    except ValueError as err:
        return str(err)
    return "no error"
