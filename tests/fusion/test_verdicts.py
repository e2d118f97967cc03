"""verdicts.py: what fused graphs learned, on disk. A file that is not one of ours is
ignored with one warning; writes are atomic and merge, so two processes writing at once
corrupt nothing and lose nothing."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import torch

from graphdispatch_backend.fusion.verdicts import FORMAT, Verdicts, device_identity, graph_key

DEVICE, RECIPE = device_identity("cpu"), "r" * 16
KEY = graph_key(["def forward(self, x): ..."], DEVICE, RECIPE)


def _verdicts(folder: Path) -> tuple[Verdicts, list[str]]:
    warned: list[str] = []
    return Verdicts(folder, lambda key, message: warned.append(message)), warned


def _keep(op: str, call: int = 1) -> dict:
    return {"op": op, "at_call": call, "detail": "differs"}


def test_a_verdict_round_trips_and_merges(tmp_path):
    v, warned = _verdicts(tmp_path)
    assert v.load(KEY, DEVICE, RECIPE) is None
    v.save(KEY, DEVICE, RECIPE, [_keep("aten.mul.Tensor")], gave_up=False)
    v.save(KEY, DEVICE, RECIPE, [_keep("aten.add.Tensor", 4)], gave_up=False)
    entry = v.load(KEY, DEVICE, RECIPE)
    assert [k["op"] for k in entry["keep"]] == ["aten.add.Tensor", "aten.mul.Tensor"]
    assert entry["torch"] == torch.__version__ and entry["format"] == FORMAT and not entry["gave_up"]
    assert not warned and not list((tmp_path / "fusion").glob(".*.tmp"))  # no temporary file left


def test_the_key_names_graph_device_recipe_and_torch():
    assert len({KEY, graph_key(["other code"], DEVICE, RECIPE), graph_key(["def forward(self, x): ..."], "cuda:X",
                RECIPE), graph_key(["def forward(self, x): ..."], DEVICE, "s" * 16)}) == 4


def _write(v: Verdicts, text: str) -> Path:
    path = v.path(KEY)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_a_corrupted_or_truncated_file_is_ignored_with_one_warning(tmp_path):
    v, warned = _verdicts(tmp_path)
    v.save(KEY, DEVICE, RECIPE, [_keep("aten.mul.Tensor")], gave_up=False)
    whole = v.path(KEY).read_text()
    for text in (whole[: len(whole) // 2], "\x00\xff garbage", "[]", json.dumps({"format": FORMAT})):
        _write(v, text)
        assert v.load(KEY, DEVICE, RECIPE) is None
    assert len(warned) == 4 and all(str(v.path(KEY)) in w for w in warned)


def test_a_verdict_of_another_torch_version_recipe_or_graph_is_ignored(tmp_path):
    v, warned = _verdicts(tmp_path)
    v.save(KEY, DEVICE, RECIPE, [_keep("aten.mul.Tensor")], gave_up=False)
    entry = json.loads(v.path(KEY).read_text())
    for field, value in (("torch", "2.12.0"), ("recipe", "x" * 16), ("key", "0" * 32), ("device", "cpu:NONE")):
        _write(v, json.dumps({**entry, field: value}))
        assert v.load(KEY, DEVICE, RECIPE) is None, field
    assert "2.12.0" in warned[0]
    _write(v, json.dumps({**entry, "keep": [{"op": 3}]}))
    assert v.load(KEY, DEVICE, RECIPE) is None and "malformed" in warned[-1]


def test_an_unwritable_folder_is_a_warning_not_an_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    v, warned = _verdicts(blocker)  # a folder that cannot be made: a file is in its place
    v.save(KEY, DEVICE, RECIPE, [_keep("aten.mul.Tensor")], gave_up=False)
    assert len(warned) == 1 and "cannot write" in warned[0]


def test_no_folder_keeps_nothing(tmp_path):
    v, _ = _verdicts(None)
    v.save(KEY, DEVICE, RECIPE, [_keep("aten.mul.Tensor")], gave_up=False)
    assert v.load(KEY, DEVICE, RECIPE) is None


def _writer(folder: str, index: int) -> None:
    v = Verdicts(folder, lambda key, message: None)
    for round_ in range(20):
        v.save(KEY, DEVICE, RECIPE, [_keep(f"aten.op{index}_{round_}.default")], gave_up=False)


def test_concurrent_writers_corrupt_nothing_and_lose_nothing(tmp_path):
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=_writer, args=(str(tmp_path), i)) for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    v, warned = _verdicts(tmp_path)
    entry = v.load(KEY, DEVICE, RECIPE)
    assert not warned and entry is not None
    assert len(entry["keep"]) == 4 * 20
