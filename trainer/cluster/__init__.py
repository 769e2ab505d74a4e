"""A small Kubernetes for the dry-run, in its own process: the API (`kube.LocalKube`, the same
`spotguard.kube.api.Kube` interface the supervisor and the agent use on a cluster), the Job
controller, the scheduler and a kubelet per simulated node. Only what the supervisor, the agent
and the example manifests (daemonset/examples/) rely on, faithful to what a cluster does there;
tests/test_k8s_*.py show the real behaviour each part stands in for.
"""
