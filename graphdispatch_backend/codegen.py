"""The Python a graph runs as: its generated forward (and Inductor's generated `call`,
`bound_call`), with every ATen call bound to the op's C++ entry (`OpOverload._op`) instead
of `torch.ops.aten.<op>.<overload>(...)`.

`OpOverload.__call__` is a Python frame around that entry (`return self._op(*args,
**kwargs)`). While Dynamo's frame-evaluation hook is installed (every call of a compiled
function), each Python frame entered goes through the hook; depending on where the
compiled function is called from, the hook's fast path is taken or not, and a graph of
600 ATen calls cost 1.8 ms from inside a function and 7.3 ms from a script's top level
(aot_eager, measured; bench/overhead.py "calling context"). Bound to their C++ entries,
the calls enter no Python frame: the cost is the same from anywhere, and lower
(1.5 against 2.1 ms from a function, same graph).

The graph module given is left as it is (passes, reports and checks read its targets);
the bound copy only runs.
"""

from __future__ import annotations

import copy
import functools
import linecache
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.graph_module import _loader

_ENTRIES: dict[torch._ops.OpOverload, Callable[..., Any]] = {}


def entry(op: torch._ops.OpOverload) -> Callable[..., Any]:
    """`op`'s C++ entry, callable as the op, named for FX code generation."""
    found = _ENTRIES.get(op)
    if found is None:
        found = functools.partial(op._op)  # a C call: no Python frame
        found.__name__ = found.__qualname__ = str(op).replace(".", "_")  # type: ignore[attr-defined]
        found.__module__ = "graphdispatch_ops"  # type: ignore[attr-defined]
        found = _ENTRIES.setdefault(op, found)
    return found


def bound_call(fn: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
    """Inductor's generated `call` with its ATen calls bound to their C++ entries. The ops
    Inductor leaves to ATen (every op the exact recipe keeps, attention, the matmuls it calls
    as ATen) are written `torch.ops.aten.<op>.<overload>(...)` in its code, each entering
    `OpOverload.__call__`, a Python frame per op per call: 100 per call of HunyuanVideo's
    fused graph, 5% of the call (one process, interleaved). A copy of the function over a
    copy of its module's globals, in which `torch` reads as torch but for `torch.ops`, whose
    overloads read as their entries (and likewise the op namespaces the module names, such
    as `aten`); the module itself is left as it is (Inductor's code cache shares it with
    every graph of the same code). A callable that is no Python function over torch's
    globals (a wrapper of Inductor's own) is returned as it is."""
    func = getattr(fn, "__func__", fn)
    if not isinstance(func, types.FunctionType) or func.__globals__.get("torch") is not torch:
        return fn
    scope = {name: _namespace(value) for name, value in func.__globals__.items()}
    scope["torch"] = _Torch()
    copied = types.FunctionType(func.__code__, scope, func.__name__, func.__defaults__, func.__closure__)
    copied.__kwdefaults__ = func.__kwdefaults__
    owner = getattr(fn, "__self__", None)
    return copied if owner is None else types.MethodType(copied, owner)


class _Reads:
    """Reads each name of `_of` once, as `_made` makes it, then as a plain attribute."""

    _of: Any

    def __init__(self, of: Any) -> None:
        self._of = of

    def __getattr__(self, name: str) -> Any:
        value = self._made(getattr(self._of, name))
        setattr(self, name, value)
        return value

    def _made(self, value: Any) -> Any:
        return value


class _Torch(_Reads):
    """torch, but for `ops` (`bound_call`)."""

    def __init__(self) -> None:
        super().__init__(torch)
        self.ops = _Ops(torch.ops)


def _namespace(value: Any) -> Any:
    """An op namespace (`torch.ops.aten`) as one whose overloads read as their entries;
    anything else (`torch.ops.load_library`, a module's other globals) as it is."""
    return _Namespace(value) if isinstance(value, torch._ops._OpNamespace) else value


class _Ops(_Reads):
    def _made(self, value: Any) -> Any:
        return _namespace(value)


class _Namespace(_Reads):
    """An op namespace whose packets give their overloads' C++ entries."""

    def _made(self, value: Any) -> Any:
        return _Packet(value) if isinstance(value, torch._ops.OpOverloadPacket) else value


class _Packet(_Reads):
    """An op packet whose overloads read as their C++ entries; called, the packet itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._of(*args, **kwargs)

    def _made(self, value: Any) -> Any:
        return entry(value) if isinstance(value, torch._ops.OpOverload) else value


def generated_forward(gm: fx.GraphModule) -> Callable[..., Any]:
    """`gm`'s generated forward, its ATen calls bound to their C++ entries (module
    docstring). A lazily recompiled GraphModule (what aot and Dynamo hand over) has a stub
    `forward` until its first call, which goes through nn.Module's call machinery on every
    call: the copy is compiled now."""
    return module_of(gm, _bound(gm)).forward


def deferred_forward(gm: fx.GraphModule) -> Callable[..., Any]:
    """`gm`'s generated forward as `gm` is now (its graph copied, its attributes taken now),
    its Python generated at its first call: for a fallback most graphs never run (the graph
    as aot lowered it, before the passes), whose code generation is tens of ms of a first
    call for a graph of a thousand nodes."""
    return _Deferred(unrun(gm, _bound(gm)))


def _bound(gm: fx.GraphModule) -> fx.Graph:
    """A copy of `gm`'s graph, its ATen calls bound to their C++ entries."""
    graph = copy.deepcopy(gm.graph)
    for node in graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            node.target = entry(node.target)
    return graph


class _Deferred:
    """A lazily recompiled module's forward, generated once, at the first call (under a lock:
    threads that race to it generate it once), and forgotten by FX when it goes."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self._gm = gm
        self._forward: Callable[..., Any] | None = None
        self._lock = threading.Lock()

    def __call__(self, *args: Any) -> Any:
        forward = self._forward
        if forward is None:
            with self._lock:
                if self._forward is None:
                    _LazyGraphModule.force_recompile(self._gm)
                    forget_source_when_gone(self._gm)
                    self._forward = self._gm.forward
                forward = self._forward
        return forward(*args)


def module_of(root: fx.GraphModule, graph: fx.Graph) -> fx.GraphModule:
    """A GraphModule of `graph` over `root`'s attributes, its code generated once, now,
    and forgotten by FX when the module goes (`forget_source_when_gone`)."""
    gm = fx.GraphModule(root, graph)
    _LazyGraphModule.force_recompile(gm)  # a lazy module generates its code here; an eager one already did
    forget_source_when_gone(gm)
    return gm


def unrun(root: fx.GraphModule, graph: fx.Graph) -> fx.GraphModule:
    """A GraphModule of `graph` over `root`'s attributes that is cut, keyed or read, never
    run as it is: its code is generated only if something asks for it (`_LazyGraphModule`),
    not here. A GraphModule generates and compiles its Python at construction, tens of ms
    for a graph of a thousand nodes: a fused graph's first call made four such copies."""
    return _LazyGraphModule(root, graph)


def forget_source_when_gone(gm: fx.GraphModule) -> None:
    """FX keeps the source of every module it generates, for tracebacks, for the process
    (`_EvalCacheLoader.eval_cache` and a `linecache` entry): for the copies made here, a
    graph's worth of text per compile, which a server that compiles and drops models all
    day would keep. Dropped with the module."""
    key = type(gm).forward.__code__.co_filename
    if key in _loader.eval_cache:
        weakref.finalize(gm, _forget, key)


def _forget(key: str) -> None:
    _loader.eval_cache.pop(key, None)
    linecache.cache.pop(key, None)
