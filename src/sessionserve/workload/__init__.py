"""Agent workloads: trace schema, loaders for public traces, replay, metrics and reports.

trace.py / trace_io.py: the schema and its JSONL form. weka, mooncake, azure,
tracelab: loaders; loader.load_trace picks one by name or content. synth.py:
the stated distributions that fill gaps. prompts.py: token ids. replay.py:
the driver (backends in inproc.py, http_backend.py). metrics, results,
report, plots: numbers and the report folder. sweep.py: policies x loads.
"""
