"""Drop-in pieces for RL and agent frameworks: verl's reward function (:mod:`.verl`), the reward
batcher shared with ``tangram-hpc serve``'s OpenRLHF endpoint (:mod:`.batching`), mini-swe-agent's
environment class (:mod:`.minisweagent`), SkyRL-gym's Python tool (:mod:`.skyrl`), and the one
client per process they share (:mod:`.clients`).  See docs/frameworks.md."""
