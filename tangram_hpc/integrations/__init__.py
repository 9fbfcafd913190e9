"""Drop-in pieces for RL frameworks: verl's reward function (:mod:`.verl`), the reward
batcher shared with ``tangram-hpc serve``'s OpenRLHF endpoint (:mod:`.batching`).
See docs/frameworks.md."""
