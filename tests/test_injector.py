"""The injection webhook over real HTTPS: admission review in, JSON patch out."""
from __future__ import annotations

import base64
import copy
import json
import ssl

import aiohttp
import jsonpatch
import pytest
from aiohttp import web

from spotguard.injector.certs import make_certificate
from spotguard.injector.patch import InjectorConfig, PodSpecError, SIDECAR_NAME, build_patch
from spotguard.injector.server import make_app, tls_context

CFG = InjectorConfig(image="spotguard:test", grace_seconds=90)


def pod(labels=None, annotations=None, **spec):
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "namespace": "default", "labels": labels or {}, "annotations": annotations or {}},
            "spec": {"containers": [{"name": "trainer", "image": "t", "env": [{"name": "A", "value": "1"}]}], **spec}}


def review(obj, uid="u-1", kind="Pod"):
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": uid, "kind": {"group": "", "version": "v1", "kind": kind}, "operation": "CREATE",
                        "object": obj}}


@pytest.fixture
async def webhook(tmp_path):
    material = make_certificate(["localhost"], ["127.0.0.1"])
    (tmp_path / "tls.crt").write_bytes(material.cert_pem)
    (tmp_path / "tls.key").write_bytes(material.key_pem)
    (tmp_path / "ca.crt").write_bytes(material.ca_pem)
    runner = web.AppRunner(make_app(CFG))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0,
                       ssl_context=tls_context(str(tmp_path / "tls.crt"), str(tmp_path / "tls.key")))
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    client_ctx = ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=client_ctx)) as session:
        async def post(body, raw=False):
            data = body if raw else json.dumps(body)
            async with session.post(f"https://127.0.0.1:{port}/mutate", data=data) as resp:
                return resp.status, await resp.json()
        yield post
    await runner.cleanup()


def applied(original, answer):
    response = answer["response"]
    assert response["allowed"] is True
    if "patch" not in response:
        return original
    assert response["patchType"] == "JSONPatch"
    ops = json.loads(base64.b64decode(response["patch"]))
    return jsonpatch.apply_patch(copy.deepcopy(original), ops)


async def test_labelled_pod_gets_native_sidecar_env_prestop_and_grace(webhook):
    original = pod(labels={"spotguard.io/inject": "true"}, terminationGracePeriodSeconds=30)
    status, answer = await webhook(review(original))
    assert status == 200 and answer["response"]["uid"] == "u-1"
    out = applied(original, answer)
    (sidecar,) = out["spec"]["initContainers"]
    assert (sidecar["name"], sidecar["restartPolicy"], sidecar["image"]) == (SIDECAR_NAME, "Always", "spotguard:test")
    trainer = out["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    assert env["A"] == "1" and env["SPOTGUARD_SIDECAR_URL"] == "http://127.0.0.1:9741"
    assert env["SPOTGUARD_TOKEN_FILE"] == "/var/run/spotguard/token" and env["SPOTGUARD_GRACE_SECONDS"] == "90"
    assert trainer["lifecycle"]["preStop"]["exec"]["command"][:3] == ["spotguard", "sidecar", "prestop"]
    assert out["spec"]["terminationGracePeriodSeconds"] == 90
    assert out["metadata"]["annotations"]["spotguard.io/injected"] == "true"
    volumes = {v["name"] for v in out["spec"]["volumes"]}
    assert {"spotguard-run", "spotguard-podinfo", "spotguard-agent-token"} <= volumes


async def test_grace_is_never_lowered(webhook):
    original = pod(labels={"spotguard.io/inject": "true"}, terminationGracePeriodSeconds=600)
    _, answer = await webhook(review(original))
    assert applied(original, answer)["spec"]["terminationGracePeriodSeconds"] == 600


async def test_unlabelled_pod_untouched(webhook):
    original = pod(labels={"app": "x"})
    _, answer = await webhook(review(original))
    assert "patch" not in answer["response"] and answer["response"]["allowed"] is True


async def test_already_injected_pod_untouched(webhook):
    original = pod(labels={"spotguard.io/inject": "true"})
    _, first = await webhook(review(original))
    injected = applied(original, first)
    _, second = await webhook(review(injected, uid="u-2"))
    assert "patch" not in second["response"] and second["response"]["uid"] == "u-2"


async def test_existing_user_prestop_is_kept(webhook):
    original = pod(labels={"spotguard.io/inject": "true"})
    original["spec"]["containers"][0]["lifecycle"] = {"preStop": {"exec": {"command": ["flush"]}}}
    _, answer = await webhook(review(original))
    assert applied(original, answer)["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"] == ["flush"]


async def test_hostfile_annotation_wires_the_sidecar(webhook):
    original = pod(labels={"spotguard.io/inject": "true"}, annotations={"spotguard.io/hostfile": "/work/hostfile"})
    original["spec"]["containers"][0]["volumeMounts"] = [{"name": "work", "mountPath": "/work"}]
    _, answer = await webhook(review(original))
    sidecar = applied(original, answer)["spec"]["initContainers"][0]
    assert "--hostfile=/work/hostfile" in sidecar["args"]
    assert {"name": "work", "mountPath": "/work"} in sidecar["volumeMounts"]


async def test_bad_annotation_allows_without_patch_and_warns(webhook):
    original = pod(labels={"spotguard.io/inject": "true"}, annotations={"spotguard.io/grace-seconds": "soon"})
    status, answer = await webhook(review(original))
    assert status == 200 and "patch" not in answer["response"]
    assert "spotguard.io/grace-seconds" in answer["response"]["warnings"][0]


@pytest.mark.parametrize("body, field", [
    (b"{not json", "not JSON"),
    ({"apiVersion": "v1", "kind": "Pod"}, "apiVersion/kind"),
    ({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {}}, "request.uid"),
    ({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
      "request": {"uid": "x", "kind": {"kind": "Pod"}, "object": "nope"}}, "request.object"),
    ([1, 2], "AdmissionReview"),
])
async def test_malformed_reviews_get_a_clear_400(webhook, body, field):
    status, answer = await webhook(body, raw=isinstance(body, bytes))
    assert status == 400 and field in answer["error"]


async def test_server_survives_garbage_then_serves(webhook):
    await webhook(b"\xff\xfe", raw=True)
    original = pod(labels={"spotguard.io/inject": "true"})
    status, answer = await webhook(review(original))
    assert status == 200 and "patch" in answer["response"]


def test_non_pod_reviews_are_allowed_untouched():
    from spotguard.injector.server import review_response
    answer = review_response(review({"kind": "Service"}, kind="Service"), CFG)
    assert answer["response"] == {"uid": "u-1", "allowed": True}


def test_patch_is_empty_for_unlabelled_pods():
    assert build_patch(pod(), CFG) == []


def test_sidecar_learns_its_pods_rank_count_and_node():
    original = pod(labels={"spotguard.io/inject": "true"})
    original["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "4"}}
    ops = build_patch(original, CFG)
    sidecar = ops[0]["value"][0]
    env = {e["name"]: e for e in sidecar["env"]}
    assert env["SPOTGUARD_LOCAL_WORLD_SIZE"]["value"] == "4"
    assert env["SPOTGUARD_NODE_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    assert sidecar["securityContext"]["runAsUser"] == 65532  # no user set by the pod: the image's
    assert sidecar["resources"]["limits"].keys() == {"cpu", "memory"}
    original["metadata"]["annotations"]["spotguard.io/local-world-size"] = "2"
    env = {e["name"]: e for e in build_patch(original, CFG)[0]["value"][0]["env"]}
    assert env["SPOTGUARD_LOCAL_WORLD_SIZE"]["value"] == "2"


@pytest.mark.parametrize("pod_ctx,container_ctx,expected", [
    ({"runAsUser": 1000, "runAsGroup": 1000}, {}, (1000, 1000)),
    ({"runAsUser": 1000}, {"runAsUser": 1001, "runAsGroup": 7}, (1001, 7)),
    ({"runAsUser": 0}, {}, (65532, None)),  # a root app reads the token anyway; the sidecar stays non-root
])
def test_sidecar_runs_as_the_apps_user_and_never_as_root(pod_ctx, container_ctx, expected):
    original = pod(labels={"spotguard.io/inject": "true"}, securityContext=pod_ctx)
    original["spec"]["containers"][0]["securityContext"] = container_ctx
    ctx = build_patch(original, CFG)[0]["value"][0]["securityContext"]
    assert (ctx["runAsUser"], ctx.get("runAsGroup"), ctx["runAsNonRoot"]) == (*expected, True)


async def test_in_place_pod_gets_rendezvous_env_ready_file_and_readiness_probe(webhook):
    """A pod of an in-place job (annotation spotguard.io/in-place): the in-place environment on
    the trainer (the container's own values win), a writable ready-file volume of its own (the
    sidecar's stays read-only) and a readiness probe on that file; a plain pod gets none of it."""
    original = pod(labels={"spotguard.io/inject": "true"}, annotations={"spotguard.io/in-place": "true"})
    original["spec"]["containers"][0]["env"].append({"name": "SPOTGUARD_RDZV_PORT", "value": "31000"})
    original["spec"]["containers"].append({"name": "helper", "image": "h",
                                           "readinessProbe": {"httpGet": {"path": "/", "port": 8080}}})
    _, answer = await webhook(review(original))
    out = applied(original, answer)
    trainer, helper = out["spec"]["containers"]
    env = {e["name"]: e for e in trainer["env"]}
    assert env["SPOTGUARD_IN_PLACE"]["value"] == "1" and "SPOTGUARD_JOIN" not in env  # the join rule decides
    assert [e["value"] for e in trainer["env"] if e["name"] == "SPOTGUARD_RDZV_PORT"] == ["31000"]
    assert {e["name"]: e.get("value") for e in helper["env"]}["SPOTGUARD_RDZV_PORT"] == "31000"  # one pod port
    assert env["SPOTGUARD_RDZV_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["SPOTGUARD_NODE"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    ready_file = env["SPOTGUARD_READY_FILE"]["value"]
    assert trainer["readinessProbe"]["exec"]["command"] == ["test", "-f", ready_file]
    assert helper["readinessProbe"] == {"httpGet": {"path": "/", "port": 8080}}  # its own probe is kept
    mounts = {m["mountPath"]: m for m in trainer["volumeMounts"]}
    ready_mount = next(m for path, m in mounts.items() if ready_file.startswith(path + "/"))
    assert not ready_mount.get("readOnly") and mounts["/var/run/spotguard"]["readOnly"] is True
    (volume,) = [v for v in out["spec"]["volumes"] if v["name"] == ready_mount["name"]]
    assert volume["emptyDir"]["medium"] == "Memory"

    plain = pod(labels={"spotguard.io/inject": "true"}, annotations={"spotguard.io/in-place": "false"})
    _, answer = await webhook(review(plain))
    trainer = applied(plain, answer)["spec"]["containers"][0]
    assert "readinessProbe" not in trainer and "SPOTGUARD_IN_PLACE" not in {e["name"] for e in trainer["env"]}


async def test_an_in_place_pod_with_a_deepspeed_config_gives_the_guard_the_sidecars_elasticity_rule(webhook):
    """The sidecar trims the hostfile by the config's elasticity rule; the Guard re-forms by the same
    file (`SPOTGUARD_DEEPSPEED_CONFIG`), so both call `group_after` with one rule. A pod that is
    not in place gets no such variable (nothing re-forms there)."""
    annotations = {"spotguard.io/hostfile": "/work/hostfile", "spotguard.io/deepspeed-config": "/work/ds.json"}
    for in_place_value, expected in (("true", "/work/ds.json"), ("false", None)):
        original = pod(labels={"spotguard.io/inject": "true"},
                       annotations={**annotations, "spotguard.io/in-place": in_place_value})
        original["spec"]["containers"][0]["volumeMounts"] = [{"name": "work", "mountPath": "/work"}]
        _, answer = await webhook(review(original))
        out = applied(original, answer)
        assert "--deepspeed-config=/work/ds.json" in out["spec"]["initContainers"][0]["args"]
        env = {e["name"]: e.get("value") for e in out["spec"]["containers"][0]["env"]}
        assert env.get("SPOTGUARD_DEEPSPEED_CONFIG") == expected


def test_a_bad_in_place_annotation_names_it():
    with pytest.raises(PodSpecError, match=r"spotguard\.io/in-place"):
        build_patch(pod(labels={"spotguard.io/inject": "true"}, annotations={"spotguard.io/in-place": "yes"}), CFG)


@pytest.mark.parametrize("entries, refused", [
    ([{"name": "SPOTGUARD_HORIZON_SECONDS", "value": "30"}], None),
    ([{"name": "SPOTGUARD_HORIZON_SECONDS", "value": "30"}, {"name": "SPOTGUARD_HORIZON_SECONDS", "value": "60"}],
     "differently"),
    ([{"name": "SPOTGUARD_HORIZON_SECONDS", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "h"}}}],
     "as a value"),
    ([{"name": "SPOTGUARD_HORIZON_SECONDS", "value": "soon"}], "seconds > 0"),
    ([{"name": "SPOTGUARD_HORIZON_SECONDS", "value": "0"}], "seconds > 0"),
])
def test_the_sidecar_holds_a_notice_with_the_guards_horizon(entries, refused):
    """The sidecar trims a hostfile by the notice rule the Guard applies, with the same horizon:
    it gets the app containers' SPOTGUARD_HORIZON_SECONDS entry as written (the supervisor reads
    the job's template with the same function); a horizon the three could read differently is
    refused, naming it."""
    original = pod(labels={"spotguard.io/inject": "true"})
    original["spec"]["containers"][0]["env"].append(entries[0])
    original["spec"]["containers"].append({"name": "logger", "image": "l", "env": entries[1:]})
    if refused is not None:
        with pytest.raises(PodSpecError, match=rf"env\[SPOTGUARD_HORIZON_SECONDS\].*{refused}"):
            build_patch(original, CFG)
        return
    env = build_patch(original, CFG)[0]["value"][0]["env"]
    assert [e for e in env if e["name"] == "SPOTGUARD_HORIZON_SECONDS"] == entries
    unset = build_patch(pod(labels={"spotguard.io/inject": "true"}), CFG)[0]["value"][0]["env"]
    assert not any(e["name"] == "SPOTGUARD_HORIZON_SECONDS" for e in unset)


def test_an_empty_horizon_is_unset_as_the_guard_reads_it():
    original = pod(labels={"spotguard.io/inject": "true"})
    original["spec"]["containers"][0]["env"].append({"name": "SPOTGUARD_HORIZON_SECONDS", "value": ""})
    env = build_patch(original, CFG)[0]["value"][0]["env"]
    assert not any(e["name"] == "SPOTGUARD_HORIZON_SECONDS" for e in env)
