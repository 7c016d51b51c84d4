"""Where routed experts live when they do not all fit the device (issue #27).

`placement.py` decides it at load: with a device memory budget, everything but the routed experts stays on the
device, and each MoE layer keeps a slot cache of its experts there (`cache.py`); all the experts stay in host
memory, page-locked on CUDA. A decode step resolves its routed experts to slots on the device and copies the
misses in (`kernels/expert_cache`), inside its CUDA graph; a step with more (token, expert) pairs than a layer has
slots (prefill) streams whole layers, double-buffered."""
