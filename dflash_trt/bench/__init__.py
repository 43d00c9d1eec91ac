"""Benchmarks run by `dflash-trt bench`: our runtime on a pair (runtime.py) and a live serving endpoint (endpoint.py)."""
