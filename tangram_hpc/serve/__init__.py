"""``tangram-hpc serve``: SandboxFusion's HTTP API on top of a tangram-hpc coordinator.

:mod:`.translate` maps bodies to actions and results to replies (pure),
:mod:`.metrics` counts requests, :mod:`.app` is the aiohttp application and
:mod:`.command` the command line.  Needs the ``serve`` extra (aiohttp).
"""
