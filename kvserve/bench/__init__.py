"""Benchmarks: offline throughput, online serving latency, KV capacity, prefix sharing.

``kvserve bench {workload,throughput,serve,capacity,prefix,plot,...}``; see bench/README.md.
"""
