"""Every shared name of spotguard's contract: labels, annotations, taints, conditions, Event
reasons, environment variables, ports and exit codes, each defined once.

These names are user-facing (docs/protocols.md, supervisor/README.md, the manifests): changing
a value breaks running clusters and launchers.
"""
from __future__ import annotations

PREFIX = "spotguard.io/"

# ---- On pods ---------------------------------------------------------------------------------
LABEL_INJECT = PREFIX + "inject"  # "true": the injector adds the sidecar; the agent posts Events on the pod
ANN_INJECTED = PREFIX + "injected"  # "true" once injected
ANN_GRACE_SECONDS = PREFIX + "grace-seconds"  # terminationGracePeriodSeconds to cover the save
ANN_HOSTFILE = PREFIX + "hostfile"  # DeepSpeed hostfile the sidecar rewrites
ANN_DEEPSPEED_CONFIG = PREFIX + "deepspeed-config"
ANN_LOCAL_WORLD_SIZE = PREFIX + "local-world-size"  # ranks in the pod
ANN_MEMBERSHIP = PREFIX + "membership"  # wire.membership.Membership, written by the supervisor

# ---- On jobs (batch/v1 Job, kubeflow.org/v1 PyTorchJob) ---------------------------------------
LABEL_MANAGED = PREFIX + "managed"  # "true" opts a job in
ANN_POLICY = PREFIX + "policy"  # elastic | fixed
ANN_MIN_REPLICAS = PREFIX + "min-replicas"
ANN_MAX_REPLICAS = PREFIX + "max-replicas"
ANN_MAX_WAIT = PREFIX + "max-wait"  # seconds
ANN_STATUS = PREFIX + "status"  # the decision record (JSON, see supervisor/record.py)
ANN_STEPS_LOST = PREFIX + "steps-lost"  # integer: steps lost, summed by the supervisor from drained pods
ANN_FALLBACK = PREFIX + "fallback"  # "on-demand" opts in to the on-demand fallback
ANN_FALLBACK_AFTER = PREFIX + "fallback-after"  # duration without spot capacity before moving (10m)
ANN_RETURN_AFTER = PREFIX + "return-after"  # duration spot capacity must stay free before returning (5m)
ANN_ON_DEMAND_MAX = PREFIX + "on-demand-max"  # backfill: at most this many on-demand replicas (default: max)

# ---- On nodes (written by the agent's node marker) --------------------------------------------
ANN_NOTICE = PREFIX + "notice"  # wire JSON of the most urgent live notice
ANN_CORDONED = PREFIX + "cordoned"  # the marker cordoned the node
ANN_NOTICE_BOOT_ID = PREFIX + "notice-boot-id"  # the node's bootID when marked
TAINT_RECLAIM = PREFIX + "reclaim"  # value: the kind of the most urgent notice
TAINT_EFFECT = "NoSchedule"

# ---- Conditions the supervisor sets on jobs (status.conditions) ------------------------------
COND_SUSPENDED = "SpotguardSuspended"
COND_MAX_WAIT = "SpotguardMaxWaitExceeded"
COND_ON_DEMAND = "SpotguardOnDemand"  # True while the job runs on on-demand capacity after a fallback

# ---- Event reasons and reporting components ---------------------------------------------------
EVENT_NOTICE = "SpotguardNotice"  # the agent, on the node and its injected pods
EVENT_SCALED = "SpotguardScaled"  # the rest: the supervisor, on the job
EVENT_CHECKPOINTING = "SpotguardCheckpointing"
EVENT_SUSPENDED = "SpotguardSuspended"
EVENT_RESUMED = "SpotguardResumed"
EVENT_MAX_WAIT = "SpotguardMaxWaitExceeded"
EVENT_INVALID_POLICY = "SpotguardInvalidPolicy"
EVENT_NOTED = "SpotguardNoticeNoted"
EVENT_FELL_BACK = "SpotguardFellBackToOnDemand"
EVENT_RETURNING = "SpotguardReturningToSpot"
EVENT_RETURNED = "SpotguardReturnedToSpot"
EVENT_LEAVING_IN_PLACE = "SpotguardLeavingInPlace"  # in-place job: the noticed node's replicas leave alone
EVENT_NOTICE_WITHDRAWN = "SpotguardNoticeWithdrawn"  # fixed job: its checkpoint wait ended, the notice withdrawn
# a backfill job's placements (supervisor/placer.py), one Event each
EVENT_PLACED_ON_SPOT = "SpotguardPlacedOnSpot"  # spot replicas for free spot slots
EVENT_WARM_STANDBY = "SpotguardWarmStandby"  # the replacement of a member that leaves or left, at once
EVENT_BACKFILLED = "SpotguardBackfilledOnDemand"  # on-demand replicas after fallback-after below max
EVENT_SWAPPING_TO_SPOT = "SpotguardSwappingToSpot"  # one spot replica to take an on-demand member's place
COMPONENT = "spotguard-supervisor"
COMPONENT_AGENT = "spotguard-agent"

# ---- Ports -----------------------------------------------------------------------------------
AGENT_PORT = 9740  # node agent (host network): notices, stream, reports
SIDECAR_PORT = 9741  # sidecar, on the pod's loopback: stream for the Guard, hooks, preStop

# ---- Environment the injector sets and the sidecar / Guard read -------------------------------
ENV_SIDECAR_URL = "SPOTGUARD_SIDECAR_URL"  # Guard: the sidecar's base URL
ENV_TOKEN_FILE = "SPOTGUARD_TOKEN_FILE"  # Guard and sidecar: the hooks bearer token file
ENV_GRACE_SECONDS = "SPOTGUARD_GRACE_SECONDS"  # Guard: the pod's termination grace
ENV_AGREE_EVERY = "SPOTGUARD_AGREE_EVERY"  # Guard
ENV_HORIZON_SECONDS = "SPOTGUARD_HORIZON_SECONDS"  # Guard, sidecar (the injector copies it)
ENV_NODE_IP = "SPOTGUARD_NODE_IP"  # sidecar: status.hostIP, where the agent listens
ENV_POD_NAME = "SPOTGUARD_POD_NAME"  # sidecar
ENV_POD_NAMESPACE = "SPOTGUARD_POD_NAMESPACE"  # sidecar
ENV_LOCAL_WORLD_SIZE = "SPOTGUARD_LOCAL_WORLD_SIZE"  # sidecar: ranks in this pod
ENV_AGENT_TOKEN_FILE = "SPOTGUARD_AGENT_TOKEN_FILE"  # sidecar: bearer token for the agent
ENV_PODINFO_DIR = "SPOTGUARD_PODINFO_DIR"  # sidecar: the downward-API volume
ENV_TERMINATION_LOG = "SPOTGUARD_TERMINATION_LOG"  # Guard: where a drained rank writes its termination message

# ---- In-place membership changes (`spotguard launch` sets them; hooks/elastic reads them) -----
ENV_IN_PLACE = "SPOTGUARD_IN_PLACE"  # "1": survivors re-form the group in place instead of exiting
ENV_NODE = "SPOTGUARD_NODE"  # the host this rank runs on, as membership `hosts` and notices name it
ENV_RDZV_HOST = "SPOTGUARD_RDZV_HOST"  # the address peers reach this host's rendezvous store at
ENV_RDZV_PORT = "SPOTGUARD_RDZV_PORT"  # the port this host's store listens on when it leads a group
ENV_JOIN = "SPOTGUARD_JOIN"  # "1": this worker joins a running job (state from a live peer)
ENV_READY_FILE = "SPOTGUARD_READY_FILE"  # a joiner creates it once ready (readiness probe / dry-run)
ENV_REFORM_TIMEOUT = "SPOTGUARD_REFORM_TIMEOUT"  # seconds a change waits on a peer before the fallback
ENV_CHANGE_TIMEOUT = "SPOTGUARD_CHANGE_TIMEOUT"  # seconds a whole change may last (default 3 x the above)
ENV_DURABLE_TIMEOUT = "SPOTGUARD_DURABLE_TIMEOUT"  # seconds a rank waits for its checkpoint's durable write
ENV_MIN_WORLD_SIZE = "SPOTGUARD_MIN_WORLD_SIZE"  # fewer survivors than this: everyone drains instead
ENV_DEEPSPEED_CONFIG = "SPOTGUARD_DEEPSPEED_CONFIG"  # Guard: the DeepSpeed config whose elasticity bounds the world
ENV_LAUNCHER_PID = "SPOTGUARD_LAUNCHER_PID"  # the launcher's pid: a worker it no longer parents leaves
ENV_DEADLINE_WATCHDOG = "SPOTGUARD_DEADLINE_WATCHDOG"  # "0": no deadline watchdog in the Guard
SIGNAL_SOURCE = "signal"  # source of the drain notice a rank makes of SIGTERM (hooks/signals.py)
SUPERVISOR_DRAIN_SOURCE = "supervisor.drain"  # source of the drain notice a membership's `drain` becomes
MEMBERSHIP_SOURCE = "spotguard.membership"  # source of the Guard's internal notice for a pushed membership
ANN_IN_PLACE = PREFIX + "in-place"  # "true": the elastic policy changes membership in place
ANN_START_AT_MIN = PREFIX + "start-at-min"  # "true": an in-place job starts once min-replicas pods are Ready
ENV_START_AT_MIN = "SPOTGUARD_START_AT_MIN"  # "1": the first group is the supervisor's first membership
ENV_DIRECT_IO = "SPOTGUARD_DIRECT_IO"  # "0": checkpoint files go through the page cache (default: O_DIRECT)
RDZV_PORT = 29411  # default rendezvous port of a training pod

# ---- Exit codes of a rank that drained after a notice (docs/protocols.md, "Guard") -----------
# A launcher or the supervisor reads them to tell a reclaim from a crash. 83: drained, the
# checkpoint is durable (restart, with fewer workers if the node is gone, and resume from it);
# 84: drained but the checkpoint failed (resuming falls back to the previous complete one).
# Any other non-zero status is a crash.
EXIT_PREEMPTED = 83
EXIT_CHECKPOINT_FAILED = 84
EXIT_DESCRIPTIONS = {
    EXIT_PREEMPTED: "preempted: drained after a notice, checkpoint durable",
    EXIT_CHECKPOINT_FAILED: "preempted: drained after a notice, checkpoint failed",
}


def describe_exit(code: int) -> str:
    """A human description of a rank's exit status (0 = finished, 83/84 = drained, else crash)."""
    if code == 0:
        return "finished"
    return EXIT_DESCRIPTIONS.get(code, f"crashed (exit status {code})")
