"""What the library tells the world: KV events in vLLM's wire format (`events.py`) and the
Prometheus metrics of managers and block managers (`metrics.py`). pyzmq, msgspec and
prometheus-client are imported only when asked for.
"""
