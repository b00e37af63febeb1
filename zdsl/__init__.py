"""zdsl: ZeRO sharding and offload driven by schedules written in a small language.

This package is the compiler; it never imports torch. The runtime lives in
``zdsl.runtime`` and is imported only by ``zdsl run`` and friends.
"""
__version__ = "0.1.0"
