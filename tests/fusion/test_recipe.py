"""recipe.py `with_inductor_keys`: the Inductor settings a framework passes in `options`
reach the fusion compile, except where the eager-numerics recipe sets the key (the recipe
wins: it is what keeps eager's bits), and each graph's report says which were applied and
which overridden."""

from __future__ import annotations

from typing import Any
from unittest import mock

import torch

import graphdispatch_backend
from graphdispatch_backend.fusion.recipe import recipe_for, with_inductor_keys

CPU = recipe_for("cpu")


def test_a_key_the_recipe_does_not_set_is_applied_and_one_it_sets_is_overridden():
    recipe, keys = with_inductor_keys(CPU, [("max_autotune", True), ("emulate_precision_casts", False),
                                            ("fallback_by_default", True)])
    assert keys == {"applied": {"max_autotune": True, "fallback_by_default": True},  # the recipe's own value
                    "overridden": {"emulate_precision_casts": {"given": False, "recipe": True}}}
    assert recipe.patches["max_autotune"] is True
    assert recipe.patches["emulate_precision_casts"] is True and recipe.patches["fallback_by_default"] is True
    assert recipe.id != CPU.id  # the verdict cache keeps what it learned per setting
    assert with_inductor_keys(CPU, []) == (CPU, {"applied": {}, "overridden": {}})
    assert with_inductor_keys(CPU, [("emulate_precision_casts", False)])[0] is CPU  # nothing applied


def _seen(settings: tuple[str, ...]) -> tuple[list[dict[str, Any]], Any]:
    """A stand-in for Inductor's compile that records the config it ran under and runs the
    segment's own graph (no C++ build: the settings are what is tested)."""
    seen: list[dict[str, Any]] = []

    def compile_fx_inner(gm: torch.fx.GraphModule, example: Any, **kwargs: Any) -> Any:
        from torch._inductor import config

        seen.append({k: config.get_config_copy()[k] for k in settings})

        def run(args: list[Any]) -> Any:
            out = gm(*args)
            args.clear()
            return out

        return run

    return seen, mock.patch("torch._inductor.compile_fx.compile_fx_inner", compile_fx_inner)


def test_the_fusion_compile_runs_under_the_given_keys_the_recipe_winning():
    seen, patch = _seen(("max_autotune", "emulate_precision_casts", "triton.cudagraphs"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    options = {"fuse": True, "cache_dir": False, "max_autotune": True, "emulate_precision_casts": False,
               "triton.cudagraphs": True, "cuda_graphs": False}
    with patch, torch.no_grad():
        compiled = torch.compile(model, backend="graphdispatch", options=options)
        for i in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
            assert torch.equal(compiled(x), model(x))
    assert seen and all(s == {"max_autotune": True, "emulate_precision_casts": True, "triton.cudagraphs": False}
                        for s in seen), seen
    (graph,) = graphdispatch_backend.latest_report()["graphs"]
    assert graph["fusion"]["inductor_keys"] == {
        "applied": {"max_autotune": True},
        "overridden": {"emulate_precision_casts": {"given": False, "recipe": True},
                       "triton.cudagraphs": {"given": True, "recipe": False}}}
    from torch._inductor import config

    assert config.max_autotune is False  # applied inside the compile only: no global setting changed


def test_without_the_keys_the_compile_runs_under_the_recipe_alone(monkeypatch):
    """The rule removed (the recipe as it was): the given key never reaches the compile."""
    import graphdispatch_backend.backend as backend

    monkeypatch.setattr(backend, "with_inductor_keys", lambda recipe, keys: (recipe, {"applied": {},
                                                                                      "overridden": {}}))
    seen, patch = _seen(("max_autotune",))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    with patch, torch.no_grad():
        torch.compile(model, backend="graphdispatch", options={
            "fuse": True, "cache_dir": False, "max_autotune": True, "cuda_graphs": False})(torch.randn(4, 8))
    assert seen and all(s == {"max_autotune": False} for s in seen)
