"""The KV cache: every block's lifetime.

``manager`` (KVManager, the one owner of every KV block's lifetime, and its integrity check),
``types`` (the plain types it shares with the modules that hold KV), ``block_pool`` (the paged
KV memory), ``host_pool`` (the host-memory tier), ``prefix_cache`` (the ``PrefixCache``
contract), ``radix`` (the prefix tree) and ``hiradix`` (the tree with host-resident nodes).
Import the module you need: this package imports nothing itself.
"""
