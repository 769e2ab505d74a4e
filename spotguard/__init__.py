"""spotguard: turn spot reclaim notices and GPU faults into consistent training checkpoints.

The product parts live in subpackages: `spotguard.agent` (node agent and notice sources),
`spotguard.hooks` (sidecar, Guard, framework adapters), `spotguard.supervisor` (job supervisor),
`spotguard.injector` (sidecar-injection webhook). Outside the product image (setup.py's
SPOTGUARD_PARTS) and never imported by it: `spotguard.trainer` (reference elastic trainer and
the dry-run) and `spotguard.emulator` (test doubles: cloud metadata emulator, fake NVML).
"""

__version__ = "0.1.0"
