"""Slurm awareness: what the cluster holds, our jobs' states, accounting records.

``cluster_view()`` picks pyslurm when it matches the running Slurm, else the
CLI JSON view; both implement :class:`ClusterView`.
"""
from .model import ACTIVE_STATES, FINAL_STATES, AccountingRecord, JobInfo, NodeInfo, PartitionInfo
from .cli_view import CliClusterView
from .pyslurm_view import PyslurmClusterView, pyslurm_mismatch
from .view import ClusterView, SlurmCommandError, slurm_version

__all__ = ["ClusterView", "SlurmCommandError", "cluster_view", "slurm_version", "NodeInfo",
           "PartitionInfo", "JobInfo", "AccountingRecord", "ACTIVE_STATES", "FINAL_STATES"]


def cluster_view(prefer: str = "auto", *, timeout: float = 30.0) -> ClusterView:
    """The cluster view to use here.

    ``prefer="auto"``: pyslurm when it imports and was built for the running
    Slurm's major release, otherwise the CLI JSON view.  ``"cli"`` or
    ``"pyslurm"`` force one (forcing pyslurm raises when it cannot work).
    The chosen view's ``why`` says why it was chosen.
    """
    if prefer not in ("auto", "cli", "pyslurm"):
        raise ValueError(f"unknown cluster view {prefer!r}: auto, cli or pyslurm")
    if prefer == "cli":
        view: ClusterView = CliClusterView(timeout=timeout)
        view.why = "CLI JSON view requested"
        return view
    problem = pyslurm_mismatch(slurm_version())
    if problem is None:
        view = PyslurmClusterView()
        view.why = "pyslurm matches the running Slurm"
        return view
    if prefer == "pyslurm":
        raise SlurmCommandError(f"pyslurm cannot be used: {problem}")
    view = CliClusterView(timeout=timeout)
    view.why = f"CLI JSON view ({problem})"
    return view
