"""Weight sync: move the trainer's weights to the rollout engines, versioned and, on request,
checksummed. Three transports (docs/weightsync.md): in-process (colocated), bucketed
torch.distributed broadcast from trainer rank 0 to engine workers, and safetensors on a
(shared) disk."""

from tidal.weightsync.base import Bucket, SyncHeader, TensorMeta, WeightSyncError, checksum, plan_buckets
from tidal.weightsync.broadcast import DEFAULT_BUCKET_BYTES, BroadcastGroup, receive_into, recv_weights, send_weights
from tidal.weightsync.disk import DiskSync
from tidal.weightsync.inprocess import InProcessSync

__all__ = [
    "DEFAULT_BUCKET_BYTES", "BroadcastGroup", "Bucket", "DiskSync", "InProcessSync", "SyncHeader", "TensorMeta",
    "WeightSyncError", "checksum", "plan_buckets", "receive_into", "recv_weights", "send_weights",
]
