"""A cloud metadata emulator: real HTTP servers that speak AWS IMDS, GCP metadata, Azure
Scheduled Events and Alibaba ECS metadata, with a control API to schedule notices and inject
faults. The tests, the benchmarks and the dry-run run against it.

The project's test doubles live here, outside the product image (setup.py's SPOTGUARD_PARTS):
the metadata emulator (`server`, `control`, `clouds/`), the fake NVML backend (`nvml`) and
`spotguard demo` (`demo`). No product module imports this package."""
