"""The cache policy over the core's pools and transfer manager: a prefix index of chained block
hashes, least-recently-used eviction by priority; offload on eviction and onboard on a hit
through the connector (`jax_kvxfer.connector`), which keeps the host pool and the stores; and
for a router over several replicas, the prefixes each holds, from their KV events."""

from ..connector.admission import AlwaysAdmit, FrequencyGate, ReuseGate, admission_policy
from .block_manager import BlockManager, BlockManagerStats, PoolExhaustedError, PrefixMatch
from .prefix_index import PrefixIndex

__all__ = ["AlwaysAdmit", "BlockManager", "BlockManagerStats", "FrequencyGate", "PoolExhaustedError",
           "PrefixIndex", "PrefixMatch", "ReuseGate", "admission_policy"]
