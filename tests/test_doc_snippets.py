"""Every ```python block in README.md, docs/ and packages/*/README.md runs as copied.

The blocks run on 2 ranks (``bagua_comm.testing.run_ranks`` with torchrun's environment set, so
a block that calls ``bc.init_process_group()`` itself joins a real 2-rank gloo job), each in a
fresh namespace and a scratch working directory. A page marks a block that is not a whole
program with an HTML comment on the line before it (invisible on the rendered page):

    <!-- fragment: setup=group,model -->
        a fragment: the named setups below run first, in order, then the block
    <!-- fragment: skip=why -->
        not run here; `why` says where it is tested instead (kept for what a test cannot host:
        a block that waits for another process, a trainer that launches its own ranks)

A block with no marker must run alone. A block holding only a ``--8<--`` include shows a file
from examples/, which tests/test_examples.py runs.
"""

from __future__ import annotations

import os
import re
import socket
import tempfile
import textwrap
import traceback
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = ([ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))
         + sorted(ROOT.glob("packages/*/README.md")))
_BLOCK = re.compile(r"^(?:<!--\s*fragment:\s*(?P<marker>[^>]*?)\s*-->\n)?```python\n(?P<code>.*?)^```",
                    re.S | re.M)

# What a fragment may assume. Each setup runs in the block's namespace, in the order named.
SETUPS = {
    # the job joined (2 ranks, gloo), with rank, world_size, with_bagua and GradientAllReduce
    "group": """
        import os
        from datetime import timedelta
        import torch
        import bagua_comm as bc
        import bagua_algos
        from bagua_algos import GradientAllReduce, with_bagua
        bc.init_process_group(timeout=timedelta(seconds=180))
        rank, world_size = bc.get_rank(), bc.get_world_size()
    """,
    # a small classifier, its optimizer, a loss and a loader of (x, y) batches
    "model": """
        import torch
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        opt = optimizer
        loss_fn = torch.nn.functional.cross_entropy
        x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
        x1, y1, x2, y2 = x, y, torch.randn(4, 8), torch.randint(0, 2, (4,))
        loader = my_loader = [(torch.randn(4, 8), torch.randint(0, 2, (4,))) for _ in range(3)]
        path = "checkpoint.pt"
        class MyModel(torch.nn.Sequential):
            def __init__(self):
                super().__init__(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        make_model = MyModel
    """,
    # a checkpoint of "model" and "optimizer" at `path`
    "checkpoint": """
        loss_fn(model(x), y).backward()
        optimizer.step()
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
    """,
    # "model"'s parameters with a .grad each
    "grads": """
        loss_fn(model(x), y).backward()
    """,
    # an algorithm instance for with_bagua
    "algorithm": """
        from bagua_algos import GradientAllReduce
        algorithm = GradientAllReduce()
    """,
    # a model wrapped with_bagua (GradientAllReduce) after "group" and "model"
    "wrapped": """
        from bagua_algos import GradientAllReduce, with_bagua
        model = with_bagua(model, [optimizer], GradientAllReduce())
    """,
    # a plain torch DDP model after "group" and "model"
    "ddp": """
        from torch.nn.parallel import DistributedDataParallel
        ddp_model = DistributedDataParallel(model)
    """,
    # variable-length token sequences: dataset (with .texts), pad_collate, epochs
    "texts": """
        import torch
        from torch.utils.data import DataLoader
        class Texts(torch.utils.data.Dataset):
            def __init__(self, n=200):
                g = torch.Generator().manual_seed(0)
                self.texts = [torch.ones(int(k), dtype=torch.long)
                              for k in torch.randint(1, 100, (n,), generator=g)]
            def __len__(self):
                return len(self.texts)
            def __getitem__(self, i):
                return self.texts[i]
        dataset = Texts()
        lengths = [len(t) for t in dataset.texts]
        def pad_collate(batch):
            return torch.nn.utils.rnn.pad_sequence(batch, batch_first=True)
        epochs = 2
    """,
    # a sampler and a batch sampler over "texts", mid-epoch, and a checkpoint dict
    "batches": """
        from bagua_data import LoadBalancingDistributedSampler, LoadBalancingDistributedBatchSampler
        sampler = LoadBalancingDistributedSampler(dataset, complexity_fn=lengths, seed=0)
        batches = LoadBalancingDistributedBatchSampler(sampler, batch_fn=lambda ix: [ix[:8]])
        loader = DataLoader(dataset, batch_sampler=batches, collate_fn=pad_collate)
        batches.set_epoch(0)
        step_in_epoch = 1
        ckpt = {}
        model = torch.nn.Linear(2, 2)
    """,
    # two tensors to exchange with the other rank
    "p2p": """
        import torch
        mine, theirs = torch.full((4,), float(rank)), torch.empty(4)
        peer = 1 - rank
    """,
    # gradients to compress: x, grad, out
    "tensors": """
        import torch
        x = torch.randn(1000)
        grad = torch.randn(1000)
        out = torch.empty(1000)
    """,
    # an error-feedback compressor for a compressed allreduce over "group"
    "compressor": """
        from bagua_comm.compression import MinMaxUInt8
        ef = MinMaxUInt8(chunks=world_size, error_feedback=True)
    """,
    # the Float16 compressor of bagua-comm's README ("Write your own compressor")
    "float16": """
        import torch
        from bagua_comm.compression import Compressor
        class Float16(Compressor):
            def __init__(self, chunks=1):
                self.chunks = chunks
            def payload_numel(self, numel, *, chunks=None):
                return 2 * numel
            def compress(self, tensor, *, chunks=None, key="default", out=None):
                half = tensor.detach().reshape(-1).to(torch.float16)
                if out is None:
                    return half.view(torch.uint8)
                out.view(torch.float16).copy_(half)
                return out
            def decompress(self, payload, out, *, chunks=None, dtype=None):
                out.view(-1).copy_(payload.view(torch.float16))
                return out
    """,
}

_RUN_MARKER = re.compile(r"^(setup=(?P<setup>[\w,]+)|skip=(?P<skip>.+))$")


def blocks() -> list[tuple[str, str | None, str | None, str]]:
    """(id, setups or None, skip reason or None, code) of every python block."""
    out = []
    for path in FILES:
        text = path.read_text(encoding="utf-8")
        for m in _BLOCK.finditer(text):
            line = text[:m.start("code")].count("\n")
            ident = f"{path.relative_to(ROOT)}:{line}"
            code, marker = m.group("code"), m.group("marker")
            if code.strip().startswith("--8<--"):
                continue                            # an examples/ file; test_examples runs it
            setup = skip = None
            if marker is not None:
                mm = _RUN_MARKER.match(marker)
                assert mm, f"{ident}: malformed marker {marker!r}"
                setup, skip = mm.group("setup"), mm.group("skip")
                if setup:
                    unknown = [s for s in setup.split(",") if s not in SETUPS]
                    assert not unknown, f"{ident}: unknown setup {unknown}; known: {list(SETUPS)}"
            out.append((ident, setup, skip, code))
    return out


BLOCKS = blocks()


def _run_all(todo, store_path):
    """On each rank: run every block in turn; return {id: (traceback or None, seconds)}.

    After each block the two ranks tell each other how it went (a file store, bounded wait):
    a block that failed on one rank only would otherwise leave the other in a collective or
    the closing barrier until the group's timeout. If the other rank does not answer within
    ``_AGREE_S``, this rank raises with what it knows, which ends the run with that message."""
    import time
    from datetime import timedelta

    import torch.distributed as dist

    import bagua_comm as bc

    rank = int(os.environ["RANK"])
    store = dist.FileStore(store_path, 2)
    results = {}
    home = os.getcwd()
    for ident, setup, code in todo:
        # a port free now, not one of a range picked at the start: gloo's listeners (ephemeral
        # ports) could take one, rank 0's store then fails to bind and rank 1 hangs connecting
        if rank == 0:
            store.set(f"{ident}/port", str(_free_port()))
        os.environ["MASTER_PORT"] = store.get(f"{ident}/port").decode()
        ns = {"__name__": "__main__"}
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            os.chdir(tmp)
            try:
                for name in (setup.split(",") if setup else []):
                    exec(compile(textwrap.dedent(SETUPS[name]), f"<setup {name}>", "exec"), ns)
                exec(compile(code, ident, "exec"), ns)
                results[ident] = None
            except BaseException:
                results[ident] = traceback.format_exc(limit=-4)
            finally:
                os.chdir(home)
            store.set(f"{ident}/{rank}", "ok" if results[ident] is None else "failed")
            try:
                store.wait([f"{ident}/{1 - rank}"], timedelta(seconds=_AGREE_S))
                other_ok = store.get(f"{ident}/{1 - rank}") == b"ok"
            except RuntimeError:      # the other rank is stuck in the block
                raise RuntimeError(f"{ident}: rank {1 - rank} did not finish within "
                                   f"{_AGREE_S} s of rank {rank}; rank {rank}'s outcome: "
                                   f"{results[ident] or 'ok'}") from None
            if bc.is_initialized():
                if results[ident] is None and other_ok:
                    bc.barrier()
                bc.destroy_process_group()
        results[ident] = (results[ident], time.perf_counter() - t0)
    return results


_AGREE_S = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def outcomes(request):
    from bagua_comm.testing import run_ranks

    # only the blocks whose test was selected (-k), all of them otherwise
    selected = {item.callspec.params["ident"] for item in request.session.items
                if getattr(item, "callspec", None) and "ident" in item.callspec.params}
    todo = [(ident, setup, code) for ident, setup, skip, code in BLOCKS
            if skip is None and ident in selected]
    env = {"MASTER_ADDR": "127.0.0.1", "PYTHONWARNINGS": "ignore"}
    with tempfile.TemporaryDirectory() as tmp:
        # below pytest-timeout's 600 s, so that a hang reports where each rank is
        per_rank = run_ranks(_run_all, 2, args=(todo, os.path.join(tmp, "outcomes")),
                             init=False, env=env, timeout=480)
    slowest = sorted(todo, key=lambda b: -per_rank[0][b[0]][1])[:5]
    print("slowest blocks:", [(b[0], round(per_rank[0][b[0]][1], 1)) for b in slowest])
    return {ident: per_rank[0][ident][0] or per_rank[1][ident][0] for ident, _, _ in todo}


def test_marker_parser():
    text = "<!-- fragment: setup=group,model -->\n```python\nx = 1\n```\n```python\ny\n```\n"
    found = [(m.group("marker"), m.group("code")) for m in _BLOCK.finditer(text)]
    assert found == [("setup=group,model", "x = 1\n"), (None, "y\n")]


def test_pages_have_blocks():
    assert len(BLOCKS) >= 40


def test_skips_say_why_and_are_few():
    skipped = [(i, s) for i, _, s, _ in BLOCKS if s is not None]
    assert all(len(s.split()) >= 3 for _, s in skipped), skipped
    assert len(skipped) <= 6, skipped


@pytest.mark.parametrize("ident,setup,skip,code", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_block_runs(outcomes, ident, setup, skip, code):
    if skip:
        pytest.skip(skip)
    assert outcomes[ident] is None, f"{ident} (setup={setup}) failed:\n{outcomes[ident]}"
