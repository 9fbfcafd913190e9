"""Slurm awareness: what the cluster holds, our jobs' states, accounting records.

``cluster_view()`` picks pyslurm when it matches the running Slurm, else the
CLI JSON view; both implement :class:`ClusterView`.
"""
from .model import ACTIVE_STATES, FINAL_STATES, AccountingRecord, JobInfo, NodeInfo, PartitionInfo
from .view import ClusterView, SlurmCommandError, cluster_view, slurm_version

__all__ = ["ClusterView", "SlurmCommandError", "cluster_view", "slurm_version", "NodeInfo",
           "PartitionInfo", "JobInfo", "AccountingRecord", "ACTIVE_STATES", "FINAL_STATES"]
