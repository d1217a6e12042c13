"""Benchmarks: `tokendance bench {engine,reuse,fidelity,memory}` and the GPU and vLLM scripts."""
