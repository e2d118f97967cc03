"""Manifest patterns (anchored fnmatch over dotted names), the suggestion for a pattern that
names nothing, and when an artifact counts as unmatched (pure functions)."""

from __future__ import annotations

import pytest

from graphdispatch_backend.artifacts.authoring import unmatched
from graphdispatch_backend.patterns import generalize, matches, suggest

LLAMA = [f"model.layers.{i}.{part}" for i in range(28) for part in ("mlp", "mlp.act_fn", "self_attn")] + ["model.norm"]


@pytest.mark.parametrize("pattern, name, hit", [
    ("layers.*.mlp", "layers.0.mlp", True),
    ("layers.*.mlp", "model.layers.0.mlp", False),  # anchored at the start
    ("layers.*.mlp", "layers.0.mlp.act_fn", False),  # and at the end
    ("*.mlp", "model.layers.0.mlp", True),  # `*` crosses dots
    ("layers.?.mlp", "layers.12.mlp", False),
    ("layers.[0-3].mlp", "layers.2.mlp", True),
    ("Layers.*.mlp", "layers.0.mlp", False),  # case-sensitive
])
def test_patterns_are_anchored_case_sensitive_fnmatch(pattern, name, hit):
    assert matches(pattern, name) is hit


def test_generalize_turns_indices_into_wildcards():
    assert generalize("model.layers.13.mlp") == "model.layers.*.mlp"
    assert generalize("blocks.0.attn#1") == "blocks.*.attn"
    assert generalize("d.k-1") == "d.k-1"


def test_a_pattern_for_the_inner_model_suggests_the_prefix():
    hint = suggest("layers.*.mlp", LLAMA)
    assert (hint.pattern, hint.count) == ("*.layers.*.mlp", 28)
    assert hint.text().startswith("did you mean `*.layers.*.mlp`: 28 regions")


def test_the_closest_names_are_names_the_suggestion_matches():
    """A trial's `ff` (a diffusers block's feed-forward, compiled inside the transformer): the
    hint said "did you mean `*.ff`", then "closest names: attn.norm_k, attn.norm_q,
    norm1.silu", the names nearest `ff` as text and none of them an `ff`."""
    parts = ("attn.norm_k", "attn.norm_q", "ff", "norm1.silu")
    names = [f"transformer_blocks.{i}.{m}" for i in range(2) for m in parts]
    hint = suggest("ff", names)
    assert (hint.pattern, hint.count) == ("*.ff", 2)
    assert hint.closest == ("transformer_blocks.0.ff", "transformer_blocks.1.ff"), hint.closest


def test_a_pattern_for_the_wrapper_suggests_dropping_its_prefix():
    names = [n.removeprefix("model.") for n in LLAMA]
    assert suggest("model.layers.*.mlp", names).pattern == "layers.*.mlp"


def test_a_misspelt_pattern_suggests_the_closest_kind():
    hint = suggest("layer.*.mlp", [n.removeprefix("model.") for n in LLAMA])
    assert (hint.pattern, hint.count) == ("layers.*.mlp", 28)
    assert hint.closest and all(c.startswith("layers.") for c in hint.closest)


def test_nothing_alike_suggests_no_pattern():
    hint = suggest("vae.decoder.*", ["a.b", "c"])
    assert hint.pattern is None and hint.text().startswith("closest names")


def test_unmatched_waits_for_modules_the_model_has():
    patterns = {"mlp": "*.layers.*.mlp", "typo": "layer.*.mlp"}
    # no region yet, but the model has the modules the first pattern names (a later graph)
    out = unmatched(patterns, {}, ["model.embed_tokens"], model_modules=LLAMA)
    assert [u.artifact for u in out] == ["typo"]
    assert "matched no region" in out[0].message() and "`layer.*.mlp`" in out[0].message()
    # hits in any graph so far count; a graph without regions and an unknown model judges nothing
    assert unmatched(patterns, {"typo": 1, "mlp": 2}, [], None) == []
    assert unmatched(patterns, {}, [], None) == []
    assert [u.artifact for u in unmatched(patterns, {}, ["model.norm"], None)] == ["mlp", "typo"]
