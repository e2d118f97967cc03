"""digest: a fingerprint of a tensor's values in bounded memory: equal values, equal digests
(whatever the layout); a changed bit, a permutation or a -0.0 changes it; the tensor is
never written."""

from __future__ import annotations

import pytest
import torch

from graphdispatch_backend.runtime.checks import digest as digest_mod
from graphdispatch_backend.runtime.checks.digest import digest, same_values

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int16,
          torch.uint8, torch.bool, torch.complex64]


def _values(dtype: torch.dtype) -> torch.Tensor:
    x = torch.arange(1, 61).reshape(3, 4, 5) * 7 % 11
    return (x % 2).bool() if dtype == torch.bool else x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_tensor_is_never_written(dtype):
    """int64 data is read as is, not copied: an in-place step would overwrite the input
    (it did: a verification's fingerprint of token ids rewrote them)."""
    x = _values(dtype)
    for t in (x, x.transpose(0, 2)):
        before = t.clone()
        digest(t)
        assert torch.equal(t, before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_equal_values_equal_digests_whatever_the_layout(dtype, monkeypatch):
    x = _values(dtype)
    strided = x.transpose(0, 1).contiguous().transpose(0, 1)
    assert torch.equal(digest(x), digest(strided)) and same_values(strided, digest(x))
    whole = digest(x)
    monkeypatch.setattr(digest_mod, "CHUNK", 7)  # many chunks, rows split: the same digest
    assert torch.equal(digest(x), whole) and torch.equal(digest(strided), whole)


def test_a_change_anywhere_changes_it():
    x = torch.randn(4, 5, 6)
    base = digest(x)
    y = x.clone()
    y[3, 4, 5] = torch.nextafter(y[3, 4, 5], torch.tensor(float("inf")))
    assert not torch.equal(digest(y), base)
    assert not torch.equal(digest(x.flatten().flip(0).reshape(4, 5, 6)), base)  # a permutation
    assert not torch.equal(digest(torch.tensor([0.0])), digest(torch.tensor([-0.0])))
    nan = torch.tensor([float("nan")])
    assert torch.equal(digest(nan), digest(nan.clone()))


def test_an_expanded_tensor_is_read_in_bounded_pieces(monkeypatch):
    monkeypatch.setattr(digest_mod, "CHUNK", 16)
    x = torch.randn(5, 1).expand(5, 100)
    assert torch.equal(digest(x), digest(x.contiguous()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_element_with_stride_zero_is_read_as_one_element(dtype):
    """A size-1 dimension's stride is anything (contiguity ignores it): `expand_as` to a
    single element gives stride 0, and a view across element sizes of such a flat tensor
    raised (the op_db bf16 sweep: `expand_as` sample 2 declined check_failed)."""
    one = _values(dtype).reshape(-1)[:1]
    expanded = one.as_strided((1,), (0,))
    assert torch.equal(digest(expanded), digest(one.clone()))
    assert torch.equal(digest(one.reshape(1, 1).as_strided((1, 1), (0, 0))), digest(one.clone().reshape(1, 1)))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32])
def test_bytes_past_the_last_whole_word_count(dtype):
    """Read as 64-bit words: a tensor whose bytes end inside a word, or whose rows do,
    still has every byte in its digest."""
    x = _values(dtype).reshape(-1)[:13]
    for i in (0, 12):
        y = x.clone()
        y[i] += 1
        assert not torch.equal(digest(y), digest(x)), i
    rows = _values(dtype)[:, :3, :]  # 15-element rows, not contiguous: words straddle them
    changed = rows.clone()
    changed[2, 2, 4] += 1
    assert torch.equal(digest(rows), digest(rows.contiguous()))
    assert not torch.equal(digest(changed), digest(rows))


def test_memory_not_aligned_to_a_word_is_read_by_copy(monkeypatch):
    monkeypatch.setattr(digest_mod, "CHUNK", 4)
    x = torch.randn(43)
    assert torch.equal(digest(x[1:]), digest(x[1:].clone()))  # 4 bytes into its storage
    assert torch.equal(digest(x[3:].view(5, 8)[:, 1:6]), digest(x[3:].view(5, 8)[:, 1:6].contiguous()))


def test_the_weighted_sum_wraps_as_the_sum_of_the_products_does():
    words = torch.randint(-(2**63), 2**63 - 1, (4097,), dtype=torch.int64, generator=torch.Generator().manual_seed(0))
    weights = digest_mod._weights(torch.device("cpu"))[:4097]
    assert torch.equal(digest_mod.weighted_sum(weights, words), (weights * words).sum())


def test_the_digest_is_its_definitions_whichever_sum_reads_the_words(monkeypatch):
    x = torch.randn(3, 1001)
    fast = digest(x)
    monkeypatch.setattr(digest_mod, "weighted_sum", lambda weights, words: (weights * words).sum())
    assert torch.equal(digest(x), fast)


def test_many_tensors_at_once_give_each_its_own_digest(monkeypatch):
    """`digests` reads the small tensors of a device as one stream, summed per tensor: the
    same digests as one at a time, for every dtype, layout and size (the large one, the
    strided one, the misaligned one and the single element take `digest` itself)."""
    monkeypatch.setattr(digest_mod, "SMALL", 40)
    base = torch.arange(200, dtype=torch.float32)
    tensors = [_values(d) for d in DTYPES] + [
        torch.randn(7, 9), torch.randn(100),  # 63 words: past SMALL here
        torch.randn(4, 6).t(), base[1:65],  # strided; 4 bytes off a word
        torch.tensor([3.0]), torch.empty(0), torch.randn(3, 8).double(), torch.randn(8, dtype=torch.bfloat16)]
    got = digest_mod.digests(tensors)
    assert len(got) == len(tensors)
    for t, d in zip(tensors, got):
        assert torch.equal(d, digest(t)), t
    assert digest_mod.digests([]) == []
