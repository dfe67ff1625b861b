"""The Python kustomize (deploy/tools/render.py) on small kustomizations: each feature the
overlays use, kustomize's exact generator hashes, and loud failures on what it does not
support. Where kubectl is installed, every fixture is also built by real kustomize and
the outputs must be identical."""

from __future__ import annotations

import shutil
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.tools import render

DEPLOYMENT = """\
apiVersion: apps/v1
kind: Deployment
metadata:
  name: app
  labels: {app: app}
spec:
  replicas: 1
  selector:
    matchLabels: {app: app}
  template:
    metadata:
      labels: {app: app}
    spec:
      serviceAccountName: runner
      containers:
        - name: main
          image: example/app:1.0
          args: ["--a=1"]
          env:
            - {name: A, value: "1"}
          volumeMounts:
            - {name: config, mountPath: /etc/app}
      volumes:
        - name: config
          configMap: {name: app-config}
        - name: creds
          secret: {secretName: app-secret}
---
apiVersion: v1
kind: ServiceAccount
metadata:
  name: runner
---
apiVersion: v1
kind: Service
metadata:
  name: app
spec:
  selector: {app: app}
  ports:
    - {port: 80, targetPort: 8080}
---
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: app
spec:
  scaleTargetRef: {apiVersion: apps/v1, kind: Deployment, name: app}
  minReplicas: 1
  maxReplicas: 3
"""


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def kubectl_build(directory: Path) -> list[dict[str, Any]] | None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return None
    out = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def build_both(directory: Path) -> list[dict[str, Any]]:
    """Our rendering, after checking it equals kubectl kustomize's (when kubectl exists)."""
    ours = render.build(directory)
    reference = kubectl_build(directory)
    if reference is not None:
        assert ours == reference
    return ours


def find(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def test_generator_hash_is_kustomizes(tmp_path: Path) -> None:
    # kubectl kustomize (kustomize v5) names this ConfigMap x-4h2mbtbbt6.
    write(tmp_path, {"kustomization.yaml": "configMapGenerator:\n- name: x\n  literals: [a=b]\n"})
    (cm,) = build_both(tmp_path)
    assert cm["metadata"]["name"] == "x-4h2mbtbbt6"
    assert cm["data"] == {"a": "b"}


def test_generators_hash_names_and_fix_references(tmp_path: Path) -> None:
    write(
        tmp_path,
        {
            "app.yaml": DEPLOYMENT,
            "app.conf": "key: value\n",
            "kustomization.yaml": """\
            resources: [app.yaml]
            configMapGenerator:
              - name: app-config
                files: [app.conf]
                literals: [MODE=prod]
            secretGenerator:
              - name: app-secret
                literals: ["token=s3cr3t-long-enough-to-wrap-the-base64-line-at-seventy-characters-yes"]
            """,
        },
    )
    objects = build_both(tmp_path)
    (cm,) = find(objects, "ConfigMap")
    (secret,) = find(objects, "Secret")
    assert cm["metadata"]["name"].startswith("app-config-") and cm["data"]["app.conf"] == "key: value\n"
    assert secret["type"] == "Opaque" and "\n" in secret["data"]["token"]  # kustomize wraps at 70
    volumes = {v["name"]: v for v in find(objects, "Deployment")[0]["spec"]["template"]["spec"]["volumes"]}
    assert volumes["config"]["configMap"]["name"] == cm["metadata"]["name"]
    assert volumes["creds"]["secret"]["secretName"] == secret["metadata"]["name"]
    # Content decides the suffix: the same data gives the same name, other data another.
    assert render.content_hash(cm) == render.content_hash(dict(cm))
    assert render.content_hash({**cm, "data": {"other": "x"}}) != render.content_hash(cm)


def test_overlay_prefix_suffix_namespace_labels_images_replicas(tmp_path: Path) -> None:
    write(
        tmp_path,
        {
            "base/app.yaml": DEPLOYMENT,
            "base/kustomization.yaml": "resources: [app.yaml]\n",
            "overlay/kustomization.yaml": """\
            resources: [../base]
            namespace: team
            namePrefix: pre-
            nameSuffix: -suf
            labels:
              - pairs: {zone: z1}
                includeSelectors: true
              - pairs: {env: prod}
                includeTemplates: true
            commonAnnotations: {owner: llmesh}
            images:
              - {name: example/app, newName: registry.example/app, newTag: "2.0"}
            replicas:
              - {name: pre-app-suf, count: 4}
            """,
        },
    )
    objects = build_both(tmp_path / "overlay")
    dep = find(objects, "Deployment")[0]
    assert dep["metadata"]["name"] == "pre-app-suf" and dep["metadata"]["namespace"] == "team"
    assert dep["spec"]["replicas"] == 4
    assert dep["spec"]["selector"]["matchLabels"] == {"app": "app", "zone": "z1"}
    assert dep["spec"]["template"]["metadata"]["labels"]["env"] == "prod"
    assert "env" not in dep["spec"]["selector"]["matchLabels"]
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.example/app:2.0"
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "pre-runner-suf"
    assert find(objects, "HorizontalPodAutoscaler")[0]["spec"]["scaleTargetRef"]["name"] == "pre-app-suf"
    assert find(objects, "Service")[0]["spec"]["selector"] == {"app": "app", "zone": "z1"}


def test_patches_strategic_merge_and_json6902(tmp_path: Path) -> None:
    write(
        tmp_path,
        {
            "app.yaml": DEPLOYMENT,
            "smp.yaml": """\
            apiVersion: apps/v1
            kind: Deployment
            metadata: {name: app}
            spec:
              template:
                spec:
                  nodeSelector: {kubernetes.io/arch: arm64}
                  containers:
                    - name: main
                      env:
                        - {name: A, value: "2"}
                        - {name: B, value: "3"}
                      resources:
                        limits: {cpu: "2"}
                  volumes:
                    - name: creds
                      $patch: delete
            """,
            "kustomization.yaml": """\
            resources: [app.yaml]
            patches:
              - path: smp.yaml
              - target: {kind: Deployment, name: app}
                patch: |-
                  - op: add
                    path: /spec/template/spec/containers/0/args/-
                    value: --b=2
                  - op: test
                    path: /spec/template/spec/containers/0/args/0
                    value: --a=1
                  - op: replace
                    path: /spec/template/spec/containers/0/args/0
                    value: --a=9
                  - op: remove
                    path: /metadata/labels/app
              - target: {kind: Service}
                patch: |-
                  apiVersion: v1
                  kind: Service
                  metadata: {name: ignored-with-a-target}
                  spec:
                    type: NodePort
            """,
        },
    )
    objects = build_both(tmp_path)
    dep = find(objects, "Deployment")[0]
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == ["--a=9", "--b=2"]
    assert {e["name"]: e["value"] for e in container["env"]} == {"A": "2", "B": "3"}
    assert container["resources"] == {"limits": {"cpu": "2"}}
    assert [v["name"] for v in dep["spec"]["template"]["spec"]["volumes"]] == ["config"]
    assert "app" not in dep["metadata"]["labels"]
    assert find(objects, "Service")[0]["spec"]["type"] == "NodePort"


def test_components_and_generator_replace(tmp_path: Path) -> None:
    write(
        tmp_path,
        {
            "base/app.yaml": DEPLOYMENT,
            "base/kustomization.yaml": """\
            resources: [app.yaml]
            configMapGenerator:
              - {name: app-config, literals: [level=base, keep=yes]}
            """,
            "comp/kustomization.yaml": """\
            apiVersion: kustomize.config.k8s.io/v1alpha1
            kind: Component
            patches:
              - target: {kind: Deployment, labelSelector: app=app}
                patch: |-
                  - op: add
                    path: /spec/template/spec/containers/0/args/-
                    value: --tls
            """,
            "overlay/kustomization.yaml": """\
            resources: [../base]
            components: [../comp]
            configMapGenerator:
              - {name: app-config, behavior: merge, literals: [level=overlay]}
            """,
        },
    )
    objects = build_both(tmp_path / "overlay")
    assert find(objects, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"][-1] == "--tls"
    (cm,) = find(objects, "ConfigMap")
    assert cm["data"] == {"level": "overlay", "keep": "yes"}


@pytest.mark.parametrize(
    ("kustomization", "message"),
    [
        ("resources: [app.yaml]\nvars: []\n", "not supported"),
        ("resources: [missing.yaml]\n", "not found"),
        ("resources: [app.yaml, app.yaml]\n", "duplicate"),
        (
            "resources: [app.yaml]\npatches:\n- target: {kind: Deployment}\n  patch: |-\n"
            "    - op: test\n      path: /spec/replicas\n      value: 7\n",
            "test failed",
        ),
        (
            "resources: [app.yaml]\npatches:\n- target: {kind: Deployment}\n  patch: |-\n"
            "    - op: replace\n      path: /spec/nothing/here\n      value: 1\n",
            "does not exist",
        ),
        ("resources: [app.yaml]\npatches:\n- target: {kind: Job}\n  patch: '[]'\n", "matches nothing"),
        ("configMapGenerator:\n- {name: x, files: [../outside.txt]}\n", "outside the kustomization root"),
        ("resources: [app.yaml]\nreplicas:\n- {name: nope, count: 2}\n", "no workload"),
    ],
)
def test_errors_are_loud(tmp_path: Path, kustomization: str, message: str) -> None:
    (tmp_path / "outside.txt").write_text("x")
    write(tmp_path / "k", {"app.yaml": DEPLOYMENT, "kustomization.yaml": kustomization})
    with pytest.raises(render.RenderError, match=message):
        render.build(tmp_path / "k")


def test_cli_prints_a_yaml_stream(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(tmp_path, {"app.yaml": DEPLOYMENT, "kustomization.yaml": "resources: [app.yaml]\n"})
    assert render.main([str(tmp_path)]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [d["kind"] for d in docs] == ["ServiceAccount", "Service", "Deployment", "HorizontalPodAutoscaler"]
    assert render.main([str(tmp_path / "missing")]) == 1
    assert "no kustomization.yaml" in capsys.readouterr().err
