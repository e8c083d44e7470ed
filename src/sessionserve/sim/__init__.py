"""The simulator: the engine's own scheduler, residency policies and KV accounting on a virtual clock.

`SimEngine` (engine.py) assembles `EngineCore` exactly as `LLMEngine` does, with
a cost-model executor (executor.py) instead of the model runner, a mover that
completes copies on the virtual clock (mover.py) and a `VirtualClock`
(clock.py). `simulate` (driver.py) replays bench workloads event by event;
`calibrate` (calibrate.py) fits a `CostProfile` (profile.py) on this machine;
`plan` (planner.py) searches replicas x tiers x policy for an SLO.
"""
