"""substitute: replace each matched region by one call to its artifact (behind a gate).

For every region (largest first, so an enclosing module wins over its children) the
injected matcher picks an artifact or records typed rejections. A selected region is cut
out into a native GraphModule (kept for the parity gate and demotion) and replaced by one
call node whose target `ctx.make_call` builds; regions overlapping a substituted one are
rejected as `overlap`. Convexity is checked again on the graph as it is now, whatever the
matcher said: once an earlier region is one call node, a path that left a later region
through one of its nodes and came back through another is a cycle, and cutting that
region would need a node to run before its input (`not_convex`).

Before::

    t = aten.t.default(w1);  addmm = aten.addmm.default(b1, x, t)
    gelu = aten.gelu.default(addmm)
    t_1 = aten.t.default(w2);  addmm_1 = aten.addmm.default(b2, gelu, t_1)
    add = aten.add.Tensor(x, addmm_1)

After::

    blocks_0_mlp = gd_artifact_mlp_exact(x, w1, b1, w2, b2)
    getitem = blocks_0_mlp[0]
    add = aten.add.Tensor(x, getitem)
"""

from __future__ import annotations

import torch.fx as fx

from graphdispatch_backend.errors import Rejection
from graphdispatch_backend.passes.context import PassContext, SubstitutionInfo
from graphdispatch_backend.passes.locate_writes import WRITE_PLAN_META, plan_writes
from graphdispatch_backend.passes.ops import WRITES_META
from graphdispatch_backend.passes.subgraph import extract, replace_with_call
from graphdispatch_backend.passes.tag_regions import is_convex


def substitute(gm: fx.GraphModule, ctx: PassContext) -> None:
    if ctx.matcher is None or ctx.make_call is None:
        return
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    taken: set[fx.Node] = set()
    replaced: dict[fx.Node, fx.Node] = {}  # erased region outputs -> their getitems
    inputs = {node: i for i, node in enumerate(gm.graph.find_nodes(op="placeholder"))}  # no pass here adds one
    ranked = sorted(ctx.regions, key=lambda r: (-len(r.nodes), order[r.nodes[0]]))
    for region in ranked:
        outcome = ctx.matcher(region)
        ctx.outcomes[region.name] = outcome
        artifact = outcome.selected
        if artifact is None:
            continue
        if taken.intersection(region.nodes):
            outcome.reject(artifact.id, Rejection.OVERLAP, "an enclosing or larger region was substituted")
            outcome.selected = None
            continue
        now = list(gm.graph.nodes)
        if not is_convex(region.nodes, now, {n: i for i, n in enumerate(now)}):
            detail = ("a path leaves the region and re-enters it" if not region.convex else
                      "a path leaves the region and re-enters it through a region substituted before it")
            outcome.reject(artifact.id, Rejection.NOT_CONVEX, detail)
            outcome.selected = None
            continue
        region.inputs = [replaced.get(n, n) for n in region.inputs]
        native = extract(region.nodes, region.inputs, region.outputs, region.input_names)
        target = ctx.make_call(region, outcome, native)
        if target is None:  # make_call recorded why (load_failed)
            outcome.selected = None
            continue
        capturable = bool(artifact.manifest.capturable)
        written = tuple(region.input_names.index(name) for name in region.mutates)
        items = replace_with_call(
            gm, region.nodes, region.inputs, region.outputs, target,
            {
                "gd_substitution": {"region": region.name, "artifact": artifact.id},
                "gd_capturable": capturable,
                "nn_module_stack": region.nodes[-1].meta.get("nn_module_stack", {}),
                "gd_regions": (),
                # what the call writes, and where: split_pieces and locate_writes read them
                **({WRITES_META: written, WRITE_PLAN_META: plan_writes(native)} if written else {}),
            },
        )
        taken.update(region.nodes)
        replaced.update(zip(region.outputs, items))
        reads = tuple(inputs[node] for i, node in enumerate(region.inputs) if node in inputs and i not in written)
        ctx.substitutions.append(SubstitutionInfo(region.name, artifact.id, capturable, reads))
