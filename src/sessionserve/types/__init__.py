"""The data types every layer shares, and the two interfaces they cross.

`model`, `cache`, `core`, `sim` and `server` all import these; this package imports no other sessionserve
layer (nor torch), so any of them can (the import contracts in pyproject.toml, `[tool.importlinter]`, check it):

- `sequence`: `Sequence` and `SequenceStatus`, a request as the engine sees it, with the `Program` (service
  received) and `ParkHint` (what the session waits on next) it carries;
- `sampling_params`: `SamplingParams`, with `guided`: `GuidedDecoding` and the model's `ToolFormat`;
- `scheduler_output`: `ScheduledChunk` and `SchedulerOutput`, one step's plan;
- `executor`: the `Executor` interface that runs a plan, and its `ExecutorOutput`;
- `kv_mover`: the `KVMover` interface that moves a session's KV between the device and a lower `Tier`,
  and its `MoveDone` results.
"""
