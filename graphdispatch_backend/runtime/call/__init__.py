"""What a call is: the placeholder contract a call must meet (contract.py), the shape key
of its values (keys.py), and its bookkeeping between the callable and its checks
(calls.py). Imports nothing of the runtime but itself."""
