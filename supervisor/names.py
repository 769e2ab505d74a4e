"""Every label, annotation, condition and Event reason the supervisor reads or writes.

These names are part of the user-facing contract (docs: supervisor/README.md, docs/protocols.md).
"""
from __future__ import annotations

PREFIX = "spotguard.io/"

# On jobs (batch/v1 Job, kubeflow.org/v1 PyTorchJob)
LABEL_MANAGED = PREFIX + "managed"  # "true" opts a job in
ANN_POLICY = PREFIX + "policy"  # elastic | fixed
ANN_MIN_REPLICAS = PREFIX + "min-replicas"
ANN_MAX_REPLICAS = PREFIX + "max-replicas"
ANN_MAX_WAIT = PREFIX + "max-wait"  # seconds
ANN_STATUS = PREFIX + "status"  # the decision record (JSON, see record.py)
ANN_STEPS_LOST = PREFIX + "steps-lost"  # integer: steps lost, summed by the supervisor from drained pods
ANN_FALLBACK = PREFIX + "fallback"  # "on-demand" opts in to the on-demand fallback
ANN_FALLBACK_AFTER = PREFIX + "fallback-after"  # duration without spot capacity before moving (10m)
ANN_RETURN_AFTER = PREFIX + "return-after"  # duration spot capacity must stay free before returning (5m)

# On pods
ANN_MEMBERSHIP = PREFIX + "membership"  # {"v":1,"generation":n,"hosts":[...],"world_size":n}

# On nodes (written by the agent)
ANN_NOTICE = PREFIX + "notice"
TAINT_RECLAIM = PREFIX + "reclaim"

# Conditions the supervisor sets on jobs (status.conditions)
COND_SUSPENDED = "SpotguardSuspended"
COND_MAX_WAIT = "SpotguardMaxWaitExceeded"
COND_ON_DEMAND = "SpotguardOnDemand"  # True while the job runs on on-demand capacity after a fallback

# Event reasons (on the job)
EVENT_SCALED = "SpotguardScaled"
EVENT_CHECKPOINTING = "SpotguardCheckpointing"
EVENT_SUSPENDED = "SpotguardSuspended"
EVENT_RESUMED = "SpotguardResumed"
EVENT_MAX_WAIT = "SpotguardMaxWaitExceeded"
EVENT_INVALID_POLICY = "SpotguardInvalidPolicy"
EVENT_NOTED = "SpotguardNoticeNoted"
EVENT_FELL_BACK = "SpotguardFellBackToOnDemand"
EVENT_RETURNING = "SpotguardReturningToSpot"
EVENT_RETURNED = "SpotguardReturnedToSpot"

# Exit codes of a rank that drained after a notice (docs/protocols.md, "Guard")
from spotguard.hooks.exit_codes import EXIT_CHECKPOINT_FAILED, EXIT_PREEMPTED  # noqa: E402,F401

COMPONENT = "spotguard-supervisor"
