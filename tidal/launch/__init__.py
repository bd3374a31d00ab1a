"""Starting a run on a cluster's own scheduler: `tidal launch slurm` (slurm.py).

The launcher only writes and submits a job; the run itself is `tidal train` with
`placement.mode=ray` joining the Ray cluster the job starts (docs/clusters.md)."""
