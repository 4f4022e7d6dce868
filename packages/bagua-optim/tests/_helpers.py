"""Shared helpers: twin models trained side by side, one plain, one fused."""

import torch


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5), torch.nn.LayerNorm(5),
        torch.nn.Linear(5, 3, bias=False))


def batch(step: int) -> torch.Tensor:
    return torch.randn(16, 7, generator=torch.Generator().manual_seed(100 + step))


def backward(model: torch.nn.Module, step: int) -> torch.Tensor:
    loss = model(batch(step)).pow(2).mean()
    loss.backward()
    return loss


def assert_same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(x, y), f"parameter {name} differs"


def assert_same_state(sd_a: dict, sd_b: dict) -> None:
    assert sd_a["state"].keys() == sd_b["state"].keys()
    for i, st in sd_a["state"].items():
        other = sd_b["state"][i]
        assert st.keys() == other.keys(), f"param {i}: {st.keys()} != {other.keys()}"
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, other[k]), f"state[{i}][{k!r}] differs"
            else:
                assert v == other[k], f"state[{i}][{k!r}] differs"
    ga = [{k: v for k, v in g.items()} for g in sd_a["param_groups"]]
    gb = [{k: v for k, v in g.items()} for g in sd_b["param_groups"]]
    assert ga == gb
