"""Small, self-contained pieces the demo, benchmarks and tests share: a tiny transformer split
into pipeline stages, a synthetic next-token task, and a local multi-process launcher."""
