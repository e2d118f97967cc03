"""The graph's callable: the entry Dynamo calls (program.py: the contract checked, the hot
path, the fallbacks), autograd graphs (autograd.py), compile stacks dropped (compile_stacks.py),
and fused graphs (fused.py). May import every other part of the runtime."""
