"""A worker's claim on one job: the fencing token that every write for the job must present."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.keys import Keys
from protocol.rq_keys import RQKeys


@dataclass(frozen=True, slots=True)
class Lease:
    """Held from claim to finish/requeue. `token` is the job's fence counter after this claim:
    the lease key holds it while the lease is ours; a higher one means another worker took over."""

    job_id: str
    token: str
    queue_name: str  # the RQ queue the job came from (its origin)
    execution_id: str  # RQ's execution record of this claim
    # The stream shard its state records (protocol/stream_shards.py); -1: none recorded.
    stream_shard: int = -1

    @property
    def composite(self) -> str:
        return RQKeys.execution_composite(self.job_id, self.execution_id)

    def lease_key(self, keys: Keys) -> str:
        return keys.lease(self.job_id)
