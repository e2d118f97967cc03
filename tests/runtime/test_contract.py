"""PlaceholderContract (what a lowered graph was traced for) and LayoutIdentity (the exact
tensors a captured graph reads in place): units, on CPU."""

from __future__ import annotations

import pytest
import torch

from graphdispatch_backend.runtime.call.contract import LayoutIdentity, PlaceholderContract, layout_identity
from graphdispatch_backend.testing import aten_graph


def test_layout_identity_names_every_field():
    base = torch.randn(4, 4)
    view = base[1:, :2]
    assert layout_identity(view) == (view.data_ptr(), (3, 2), (4, 1), torch.float32, torch.device("cpu"), 4)


# -- PlaceholderContract -----------------------------------------------------------------------


def test_contract_accepts_what_it_was_traced_for():
    contract = PlaceholderContract.of(aten_graph(lambda x, w: x @ w, torch.randn(2, 4), torch.randn(4, 4)).gm)
    args = [torch.randn(2, 4), torch.randn(4, 4)]
    assert contract.explain(args) is None
    assert contract.check(args)  # the first passing call builds the guards
    assert contract.check([torch.randn(2, 4), torch.randn(4, 4)])  # later calls: the compiled guards


@pytest.mark.parametrize(("args", "words"), [
    ([torch.randn(2, 4)], "1 inputs, the graph takes"),
    ([torch.randn(3, 4), torch.randn(4, 4)], "size (3, 4), expected 2 at dim 0"),
    ([torch.randn(2, 4, dtype=torch.float64), torch.randn(4, 4)], "torch.float64"),
    ([torch.randn(2, 4, 1), torch.randn(4, 4)], "rank 3"),
    ([torch.randn(2, 4), 3.0], "expected a tensor"),
])
def test_contract_names_the_first_broken_input(args, words):
    contract = PlaceholderContract.of(aten_graph(lambda x, w: x @ w, torch.randn(2, 4), torch.randn(4, 4)).gm)
    assert not contract.check(args)
    assert words in contract.explain(args)


def test_contract_checks_scalar_types():
    # metas as a lowered graph's placeholders carry them: a tensor, then an int and a float symbol
    contract = PlaceholderContract([torch.empty(3), 2, 0.5])
    assert contract.check([torch.randn(3), 5, 1.5])
    assert contract.check([torch.randn(3), True, 1.5])  # a bool is an int, as in Python
    assert not contract.check([torch.randn(3), 2.5, 1.5])
    assert contract.explain([torch.randn(3), 2.5, 1.5]) == "input 1: float, expected int"
    assert not contract.check([torch.randn(3), 2, 1])
    assert contract.explain([torch.randn(3), 2, 1]) == "input 2: int, expected float"


def test_contract_allows_dynamic_sizes_and_any_strides():
    x = torch.randn(2, 4)
    torch._dynamo.mark_dynamic(x, 0)
    gm = aten_graph(lambda t, w: t @ w, x, torch.randn(4, 4)).gm
    contract = PlaceholderContract.of(gm)
    assert [type(m).__name__ for m in contract._metas] == ["SymInt", "FakeTensor", "FakeTensor"]
    w = torch.randn(4, 4)

    def args(t: torch.Tensor) -> list[object]:
        return [t.shape[0], t, w]  # Dynamo passes the dynamic size first

    assert contract.check(args(torch.randn(2, 4)))
    assert contract.check(args(torch.randn(5, 4)))  # the dynamic dim may change
    assert contract.check(args(torch.randn(4, 5).t()))  # strides are not part of the contract
    assert not contract.check(args(torch.randn(5, 3)))


def test_contract_guards_see_what_metadata_does_not():
    contract = PlaceholderContract.of(aten_graph(lambda t: t * 2, torch.randn(3)).gm)
    assert contract.check([torch.randn(3)])  # builds the guards from a real call
    odd = torch.randn(3, requires_grad=True)
    assert not contract.check([odd])
    assert "tensor properties differ" in contract.explain([odd])


# -- LayoutIdentity --------------------------------------------------------------------------------


@pytest.mark.parametrize("positions", [[0], [0, 2]], ids=["one position", "two positions"])
def test_identity_of_the_same_tensors_matches(positions):
    args = [torch.randn(4), 7, torch.randn(2, 2)]
    identity = LayoutIdentity(positions, args)
    assert identity.mismatch(args) is None
    assert identity.mismatch([args[0], 8, args[2]]) is None  # positions outside are not its business


def test_identity_names_a_new_tensor():
    args = [torch.randn(4), torch.randn(2, 2)]
    identity = LayoutIdentity([0, 1], args)
    assert identity.mismatch([args[0], args[1].clone()]) == 1
    assert identity.mismatch([args[0].clone(), args[1]]) == 0


def test_identity_names_a_restrided_view_of_the_same_block():
    base = torch.randn(4, 4)
    identity = LayoutIdentity([0], [base])
    restrided = base.t()
    assert restrided.data_ptr() == base.data_ptr()
    assert identity.addresses_match([restrided])
    assert not identity.layouts_match([restrided])
    assert identity.mismatch([restrided]) == 0


def test_identity_names_a_reinterpreted_dtype_at_the_same_address():
    base = torch.randn(4)
    identity = LayoutIdentity([0], [base])
    assert identity.mismatch([base.view(torch.int32)]) == 0


def test_identity_sees_requires_grad_through_its_guards():
    base = torch.randn(4)
    identity = LayoutIdentity([1], [None, base])
    base.requires_grad_(True)  # same tensor, same layout: only the guards can tell
    assert identity.mismatch([None, base]) == 1


def test_identity_of_nothing_never_mismatches():
    identity = LayoutIdentity([], [torch.randn(2)])
    assert identity.mismatch([torch.randn(2)]) is None


class WritesOne(torch.nn.Module):
    """Writes `a` in place (a counter, a cache) and reads `b`."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a.add_(1.0)
        return self.lin(b) + a


@pytest.mark.parametrize("cuda_graphs", [False, "emulate"])
def test_an_input_the_graph_writes_passed_overlapping_another_runs_the_dynamo_graph(cuda_graphs):
    """Traced with `a` and `b` apart, then called with two overlapping views of one tensor:
    eager's write into `a` is seen through `b`, which neither the lowered graph nor a
    replay (each input its own copy) computes (a trial: 24 of 24 replays off). Such a call
    runs the Dynamo graph, counted `contract_mismatch`; two views of one buffer that do not
    overlap (a cache's K and V planes) are no mismatch."""
    import graphdispatch_backend

    torch.manual_seed(0)
    model = WritesOne().eval()
    compiled = torch.compile(model, backend="graphdispatch", options={"cuda_graphs": cuda_graphs})

    def apart(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)

    def planes(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        base = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(i))
        return base[0], base[1]

    def overlapping(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        base = torch.randn(5, 8, generator=torch.Generator().manual_seed(i))
        return base[1:], base[:4]

    with torch.no_grad():
        for i, make in enumerate([apart] * 6 + [planes] * 3 + [overlapping] * 3):
            mine, theirs = make(i), make(i)
            assert torch.equal(compiled(*mine), model(*theirs)), (i, make.__name__)
            assert torch.equal(mine[0], theirs[0]) and torch.equal(mine[1], theirs[1]), i
    (graph,) = graphdispatch_backend.latest_report()["graphs"]
    assert graph["cuda_graph"]["eager_by_reason"].get("contract_mismatch") == 3, graph["cuda_graph"]
    assert "input 0 (a), which the graph writes, overlaps input 3 (b)" in graph["contract_detail"], graph
