"""GPU health: the NVML backend interface, its real implementation, and the policy.

- `backend.GpuBackend`: the small interface the GPU source uses (index-based, raises `pynvml`
  error classes);
- `nvml_backend.NvmlBackend`: the real one over `pynvml` (from nvidia-ml-py), imported lazily;
- the scriptable fake for tests and the dry-run is a test double: `spotguard.emulator.nvml`,
  not part of the product (loaded by name only for `--gpu fake:<file>`);
- `policy.GpuPolicy`: what each signal means (ignore / warn / fatal), as data;
- `select.make_backend(spec)`: turns the agent's `--gpu` flag into a backend.
"""
