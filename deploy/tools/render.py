"""A small kustomize in Python: renders deploy/k8s overlays without a kustomize binary.

It implements the subset of kustomize (v5 semantics) that llmesh's manifests use, and
fails loudly on any kustomization field it does not know, so an overlay can never be
rendered silently wrong:

- ``resources`` (files and directories), ``components`` (``kind: Component``);
- ``patches`` (strategic-merge subset or JSON 6902, inline or ``path``, with ``target``
  selectors: group, version, kind, name regex, namespace, labelSelector), and the legacy
  ``patchesStrategicMerge`` / ``patchesJson6902``;
- ``namespace``, ``namePrefix``, ``nameSuffix``, ``commonLabels``, ``labels``
  (``includeSelectors`` / ``includeTemplates``), ``commonAnnotations``, ``images``,
  ``replicas``;
- ``configMapGenerator`` / ``secretGenerator`` (``files``, ``literals``, ``envs``,
  ``behavior`` create/merge/replace, ``options``) and ``generatorOptions``, with
  kustomize's content-hash name suffix;
- name references (a renamed ConfigMap, Secret, ServiceAccount, PVC or Deployment is
  renamed where pods, HPAs and volumes refer to it).

Order of operations follows kustomize: resources, components, generators, then the
transformers (patches, namespace, prefix, suffix, labels, annotations, JSON 6902
patches, replicas, images); hash suffixes and name references are fixed last.
``tests/deploy`` checks the output against ``kubectl kustomize`` where that exists.

Usage: ``python -m deploy.tools.render deploy/k8s/overlays/prod > prod.yaml``.
"""

from __future__ import annotations

import argparse
import base64
import copy
import hashlib
import json
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")

# Fields this renderer understands; anything else in a kustomization is an error.
KNOWN_FIELDS = {
    "apiVersion", "kind", "metadata", "resources", "components", "patches",
    "patchesStrategicMerge", "patchesJson6902", "namespace", "namePrefix", "nameSuffix",
    "commonLabels", "labels", "commonAnnotations", "images", "replicas",
    "configMapGenerator", "secretGenerator", "generatorOptions",
}

# Kinds that are not namespaced (the namespace transformer leaves them alone).
CLUSTER_SCOPED = {
    "Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
    "PersistentVolume", "StorageClass", "PriorityClass", "MutatingWebhookConfiguration",
    "ValidatingWebhookConfiguration", "APIService", "IngressClass", "RuntimeClass",
}

WORKLOADS = {"Deployment", "ReplicaSet", "StatefulSet", "DaemonSet"}

# kustomize's legacy output order (``kubectl kustomize`` default); other kinds sort
# between these two lists, by kind.
ORDER_FIRST = [
    "Namespace", "ResourceQuota", "StorageClass", "CustomResourceDefinition",
    "ServiceAccount", "PodSecurityPolicy", "Role", "ClusterRole", "RoleBinding",
    "ClusterRoleBinding", "ConfigMap", "Secret", "Endpoints", "Service", "LimitRange",
    "PriorityClass", "PersistentVolume", "PersistentVolumeClaim", "Deployment",
    "StatefulSet", "CronJob", "PodDisruptionBudget",
]
ORDER_LAST = ["MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"]

# Strategic-merge keys of the lists this renderer merges by key (others are replaced).
MERGE_KEYS = {
    "containers": "name", "initContainers": "name", "ephemeralContainers": "name",
    "volumes": "name", "volumeMounts": "mountPath", "volumeDevices": "devicePath",
    "env": "name", "imagePullSecrets": "name", "hostAliases": "ip",
    "topologySpreadConstraints": "topologyKey",
}


class RenderError(Exception):
    """A kustomization that this renderer (or kustomize) would reject."""


@dataclass
class Resource:
    """One object being rendered, with the names it had before this build renamed it."""

    obj: dict[str, Any]
    generated: bool = False
    """Made by a generator: gets a content-hash suffix unless disabled."""
    hash_suffix: bool = True
    previous_names: list[str] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return str(self.obj.get("kind", ""))

    @property
    def name(self) -> str:
        return str(self.obj.get("metadata", {}).get("name", ""))

    @property
    def namespace(self) -> str:
        return str(self.obj.get("metadata", {}).get("namespace", "") or "")

    @property
    def group_version(self) -> tuple[str, str]:
        api = str(self.obj.get("apiVersion", ""))
        if "/" in api:
            group, version = api.split("/", 1)
            return group, version
        return "", api

    def rename(self, new: str) -> None:
        if new != self.name:
            self.previous_names.append(self.name)
            self.obj["metadata"]["name"] = new

    def ident(self) -> tuple[str, str, str]:
        return (self.kind, self.namespace, self.name)


# ---------------------------------------------------------------------------- loading


def _kustomization_file(directory: Path) -> Path:
    for name in KUSTOMIZATION_FILES:
        path = directory / name
        if path.is_file():
            return path
    raise RenderError(f"{directory}: no kustomization.yaml")


def _inside(root: Path, relative: str) -> Path:
    """``relative`` under ``root``; kustomize refuses files outside the kustomization root."""
    path = (root / relative).resolve()
    if path != root.resolve() and root.resolve() not in path.parents:
        raise RenderError(f"{root}: {relative!r} is outside the kustomization root")
    return path


def load_documents(path: Path) -> list[dict[str, Any]]:
    """Every non-empty YAML document of a manifest file."""
    with path.open(encoding="utf-8") as handle:
        docs = [doc for doc in yaml.safe_load_all(handle) if doc is not None]
    for doc in docs:
        if not isinstance(doc, dict) or "kind" not in doc or "metadata" not in doc:
            raise RenderError(f"{path}: every document must be a Kubernetes object")
    return docs


def _load_patch(root: Path, entry: dict[str, Any] | str) -> Any:
    if isinstance(entry, str):
        return yaml.safe_load(_inside(root, entry).read_text(encoding="utf-8"))
    if "path" in entry:
        return yaml.safe_load(_inside(root, entry["path"]).read_text(encoding="utf-8"))
    if "patch" in entry:
        return yaml.safe_load(entry["patch"])
    raise RenderError(f"{root}: patch entry needs 'path' or 'patch': {entry}")


# ---------------------------------------------------------------------------- build


def build(directory: str | Path) -> list[dict[str, Any]]:
    """Render the kustomization in ``directory``; returns the objects in kustomize's order."""
    root = Path(directory)
    resources = _accumulate(root, [], stack=())
    _add_hashes_and_fix_references(resources)
    return [r.obj for r in sorted(resources, key=_legacy_order)]


def _legacy_order(res: Resource) -> tuple[int, str, str, str]:
    kind = res.kind
    if kind in ORDER_FIRST:
        rank = ORDER_FIRST.index(kind)
    elif kind in ORDER_LAST:
        rank = len(ORDER_FIRST) + 1 + ORDER_LAST.index(kind)
    else:
        rank = len(ORDER_FIRST)
    return (rank, kind if rank == len(ORDER_FIRST) else "", res.namespace, res.name)


def _accumulate(directory: Path, inherited: list[Resource], stack: tuple[Path, ...]) -> list[Resource]:
    directory = directory.resolve()
    if directory in stack:
        raise RenderError(f"cycle: {directory} includes itself")
    stack = (*stack, directory)
    kfile = _kustomization_file(directory)
    spec = yaml.safe_load(kfile.read_text(encoding="utf-8")) or {}
    unknown = set(spec) - KNOWN_FIELDS
    if unknown:
        raise RenderError(f"{kfile}: fields not supported by this renderer: {sorted(unknown)}")
    kind = spec.get("kind", "Kustomization")
    is_component = kind == "Component"
    if kind not in ("Kustomization", "Component"):
        raise RenderError(f"{kfile}: unknown kind {kind!r}")
    if is_component and not stack[:-1]:
        raise RenderError(f"{kfile}: a Component cannot be built on its own")

    resources: list[Resource] = inherited if is_component else []
    for entry in spec.get("resources", []) or []:
        target = (directory / entry).resolve()
        if target.is_dir():
            sub_spec = yaml.safe_load(_kustomization_file(target).read_text(encoding="utf-8")) or {}
            if sub_spec.get("kind") == "Component":
                raise RenderError(f"{kfile}: {entry} is a Component; list it under components")
            _add_all(resources, _accumulate(target, [], stack), kfile)
        elif target.is_file():
            _inside(directory, entry)  # files (unlike kustomizations) must be under the root
            _add_all(resources, [Resource(doc) for doc in load_documents(target)], kfile)
        else:
            raise RenderError(f"{kfile}: resource {entry!r} not found")

    for entry in spec.get("components", []) or []:
        target = (directory / entry).resolve()
        comp_spec = yaml.safe_load(_kustomization_file(target).read_text(encoding="utf-8")) or {}
        if comp_spec.get("kind") != "Component":
            raise RenderError(f"{kfile}: {entry} is not a Component")
        _accumulate(target, resources, stack)

    _run_generators(directory, spec, resources, kfile)
    _run_transformers(directory, spec, resources, kfile)
    return resources


def _add_all(resources: list[Resource], new: Iterable[Resource], where: Path) -> None:
    seen = {r.ident() for r in resources}
    for res in new:
        if res.ident() in seen:
            raise RenderError(f"{where}: duplicate resource {res.ident()}")
        seen.add(res.ident())
        resources.append(res)


# ---------------------------------------------------------------------------- generators


def _key_and_path(root: Path, entry: str) -> tuple[str, Path]:
    if "=" in entry:
        key, rel = entry.split("=", 1)
        return key, _inside(root, rel)
    path = _inside(root, entry)
    return path.name, path


def _literal(entry: str) -> tuple[str, str]:
    if "=" not in entry:
        raise RenderError(f"literal {entry!r} must be KEY=VALUE")
    key, value = entry.split("=", 1)
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        value = value[1:-1]
    return key, value


def _env_file(path: Path) -> dict[str, str]:
    values: dict[str, str] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, value = _literal(line)
        values[key] = value
    return values


def _generated_data(root: Path, gen: dict[str, Any]) -> dict[str, str]:
    data: dict[str, str] = {}

    def put(key: str, value: str) -> None:
        if key in data:
            raise RenderError(f"{gen.get('name')}: duplicate key {key!r}")
        data[key] = value

    for entry in gen.get("envs", []) or ([gen["env"]] if gen.get("env") else []):
        for key, value in _env_file(_inside(root, entry)).items():
            put(key, value)
    for entry in gen.get("files", []) or []:
        key, path = _key_and_path(root, entry)
        put(key, path.read_text(encoding="utf-8"))
    for entry in gen.get("literals", []) or []:
        put(*_literal(entry))
    return data


def _run_generators(root: Path, spec: dict[str, Any], resources: list[Resource], kfile: Path) -> None:
    options = spec.get("generatorOptions", {}) or {}
    for kind, field_name in (("ConfigMap", "configMapGenerator"), ("Secret", "secretGenerator")):
        for gen in spec.get(field_name, []) or []:
            name = gen["name"]
            namespace = gen.get("namespace", "")
            behavior = gen.get("behavior", "create")
            data = _generated_data(root, gen)
            opts = {**options, **(gen.get("options", {}) or {})}
            payload = {k: _kyaml_base64(v) for k, v in data.items()} if kind == "Secret" else data
            existing = [
                r for r in resources
                if r.kind == kind and name in (r.name, *r.previous_names)
                and (not namespace or r.namespace == namespace)
            ]
            if behavior == "create":
                if existing:
                    raise RenderError(f"{kfile}: {kind} {name} already exists; use behavior merge/replace")
                obj: dict[str, Any] = {"apiVersion": "v1", "kind": kind, "metadata": {"name": name}}
                if namespace:
                    obj["metadata"]["namespace"] = namespace
                if kind == "Secret":
                    obj["type"] = gen.get("type", "Opaque")
                obj["data"] = payload
                _apply_generator_options(obj, opts)
                res = Resource(obj, generated=True,
                               hash_suffix=not opts.get("disableNameSuffixHash", False))
                _add_all(resources, [res], kfile)
            elif behavior in ("merge", "replace"):
                if len(existing) != 1:
                    raise RenderError(f"{kfile}: {behavior} needs exactly one existing {kind} {name}")
                target = existing[0]
                if behavior == "replace":
                    target.obj["data"] = payload
                else:
                    target.obj.setdefault("data", {}).update(payload)
                _apply_generator_options(target.obj, opts)
                if "disableNameSuffixHash" in opts:
                    target.hash_suffix = not opts["disableNameSuffixHash"]
            else:
                raise RenderError(f"{kfile}: unknown generator behavior {behavior!r}")


def _kyaml_base64(value: str) -> str:
    """Base64 as kustomize writes Secret data: 70-character lines, each ending in a
    newline when there is more than one (this text is also what the name hash covers)."""
    encoded = base64.b64encode(value.encode()).decode()
    line = 70
    if len(encoded) // line + 1 <= 1:
        return encoded
    return "".join(encoded[i:i + line] + "\n" for i in range(0, len(encoded), line))


def _apply_generator_options(obj: dict[str, Any], opts: dict[str, Any]) -> None:
    meta = obj["metadata"]
    if opts.get("labels"):
        meta.setdefault("labels", {}).update(opts["labels"])
    if opts.get("annotations"):
        meta.setdefault("annotations", {}).update(opts["annotations"])
    if opts.get("immutable"):
        obj["immutable"] = True


# ---------------------------------------------------------------------------- transformers


def _run_transformers(root: Path, spec: dict[str, Any], resources: list[Resource], kfile: Path) -> None:
    for entry in spec.get("patchesStrategicMerge", []) or []:
        _apply_patch(resources, _load_patch(root, entry), None, kfile)
    for entry in spec.get("patches", []) or []:
        _apply_patch(resources, _load_patch(root, entry), entry.get("target"), kfile)

    renamed_from = {id(r): r.name for r in resources}
    if spec.get("namespace"):
        _set_namespace(resources, spec["namespace"])
    for r in resources:
        if spec.get("namePrefix") and r.kind not in ("Namespace", "CustomResourceDefinition"):
            r.rename(spec["namePrefix"] + r.name)
        if spec.get("nameSuffix") and r.kind not in ("Namespace", "CustomResourceDefinition"):
            r.rename(r.name + spec["nameSuffix"])

    if spec.get("commonLabels"):
        _add_labels(resources, spec["commonLabels"], selectors=True, templates=True)
    for entry in spec.get("labels", []) or []:
        selectors = bool(entry.get("includeSelectors", False))
        templates = selectors or bool(entry.get("includeTemplates", False))
        _add_labels(resources, entry.get("pairs", {}), selectors=selectors, templates=templates)
    if spec.get("commonAnnotations"):
        for r in resources:
            _add_annotations(r, spec["commonAnnotations"])

    for entry in spec.get("patchesJson6902", []) or []:
        _apply_patch(resources, _load_patch(root, entry), entry.get("target"), kfile, json6902=True)
    for entry in spec.get("replicas", []) or []:
        matched = [r for r in resources if r.kind in WORKLOADS and r.name == entry["name"]]
        if not matched:
            raise RenderError(f"{kfile}: replicas: no workload named {entry['name']}")
        for r in matched:
            r.obj.setdefault("spec", {})["replicas"] = int(entry["count"])
    for entry in spec.get("images", []) or []:
        for r in resources:
            _set_images(r.obj, entry)

    renames = {
        (r.kind, r.namespace, renamed_from[id(r)]): r.name
        for r in resources if id(r) in renamed_from and renamed_from[id(r)] != r.name
    }
    if renames:
        _fix_references(resources, renames)


def _set_namespace(resources: list[Resource], namespace: str) -> None:
    for r in resources:
        if r.kind == "Namespace":
            # kustomize renames Namespace objects to the kustomization's namespace.
            r.rename(namespace)
        elif r.kind not in CLUSTER_SCOPED:
            r.obj["metadata"]["namespace"] = namespace
        if r.kind in ("RoleBinding", "ClusterRoleBinding"):
            for subject in r.obj.get("subjects", []) or []:
                if subject.get("kind") == "ServiceAccount":
                    subject["namespace"] = namespace


# Paths (kind-specific) that commonLabels / labels(includeSelectors) also write, after
# kustomize's commonLabels field specs; (path, create-if-missing).
_SELECTOR_PATHS: dict[str, list[tuple[tuple[str, ...], bool]]] = {
    "Service": [(("spec", "selector"), True)],
    "ReplicationController": [(("spec", "selector"), True)],
    "Deployment": [(("spec", "selector", "matchLabels"), True)],
    "ReplicaSet": [(("spec", "selector", "matchLabels"), True)],
    "DaemonSet": [(("spec", "selector", "matchLabels"), True)],
    "StatefulSet": [(("spec", "selector", "matchLabels"), True)],
    "Job": [(("spec", "selector", "matchLabels"), False)],
    "PodDisruptionBudget": [(("spec", "selector", "matchLabels"), False)],
    "NetworkPolicy": [(("spec", "podSelector", "matchLabels"), False)],
}
# Label selectors inside pod templates that kustomize also extends (create: false).
_POD_SELECTOR_LISTS = (
    ("topologySpreadConstraints",),
    ("affinity", "podAffinity", "requiredDuringSchedulingIgnoredDuringExecution"),
    ("affinity", "podAntiAffinity", "requiredDuringSchedulingIgnoredDuringExecution"),
)
_TEMPLATE_PATHS: dict[str, list[tuple[str, ...]]] = {
    **{kind: [("spec", "template", "metadata", "labels")] for kind in
       (*WORKLOADS, "ReplicationController", "Job")},
    "CronJob": [("spec", "jobTemplate", "metadata", "labels"),
                ("spec", "jobTemplate", "spec", "template", "metadata", "labels")],
}


def _set_map(obj: dict[str, Any], path: tuple[str, ...], values: dict[str, Any], create: bool) -> None:
    node: Any = obj
    for key in path:
        if not isinstance(node, dict):
            return
        if key not in node or node[key] is None:
            if not create:
                return
            node[key] = {}
        node = node[key]
    if isinstance(node, dict):
        node.update({k: str(v) for k, v in values.items()})


def _add_labels(
    resources: list[Resource], pairs: dict[str, Any], *, selectors: bool, templates: bool
) -> None:
    for r in resources:
        _set_map(r.obj, ("metadata", "labels"), pairs, True)
        if templates:
            for path in _TEMPLATE_PATHS.get(r.kind, []):
                _set_map(r.obj, path, pairs, True)
        if selectors:
            for path, create in _SELECTOR_PATHS.get(r.kind, []):
                _set_map(r.obj, path, pairs, create)
            if r.kind in WORKLOADS:
                pod = ((r.obj.get("spec") or {}).get("template") or {}).get("spec") or {}
                for path in _POD_SELECTOR_LISTS:
                    node: Any = pod
                    for key in path:
                        node = node.get(key) if isinstance(node, dict) else None
                    for term in node or []:
                        if isinstance(term, dict) and "labelSelector" in term:
                            _set_map(term, ("labelSelector", "matchLabels"), pairs, False)
            if r.kind == "NetworkPolicy":
                spec = r.obj.get("spec", {})
                for rule in spec.get("ingress", []) or []:
                    for peer in rule.get("from", []) or []:
                        if "podSelector" in peer:
                            _set_map(peer, ("podSelector", "matchLabels"), pairs, False)
                for rule in spec.get("egress", []) or []:
                    for peer in rule.get("to", []) or []:
                        if "podSelector" in peer:
                            _set_map(peer, ("podSelector", "matchLabels"), pairs, False)


def _add_annotations(r: Resource, pairs: dict[str, Any]) -> None:
    _set_map(r.obj, ("metadata", "annotations"), pairs, True)
    for path in _TEMPLATE_PATHS.get(r.kind, []):
        _set_map(r.obj, (*path[:-1], "annotations"), pairs, True)


_IMAGE_RE = re.compile(
    r"^(?P<name>[^@]+?)(?::(?P<tag>[\w][\w.-]{0,127}))?(?:@(?P<digest>[A-Za-z0-9_+.-]+:[0-9a-fA-F]+))?$"
)


def _split_image(image: str) -> tuple[str, str, str]:
    match = _IMAGE_RE.match(image)
    if not match:
        return image, "", ""
    return match["name"], match["tag"] or "", match["digest"] or ""


def _containers(obj: Any) -> Iterator[dict[str, Any]]:
    """Every container (and init container) anywhere in an object."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key in ("containers", "initContainers", "ephemeralContainers") and isinstance(value, list):
                yield from (c for c in value if isinstance(c, dict))
            else:
                yield from _containers(value)
    elif isinstance(obj, list):
        for item in obj:
            yield from _containers(item)


def _set_images(obj: dict[str, Any], entry: dict[str, Any]) -> None:
    for container in _containers(obj):
        if "image" not in container:
            continue
        name, tag, digest = _split_image(str(container["image"]))
        if name != entry["name"]:
            continue
        name = entry.get("newName", name)
        if entry.get("digest"):
            container["image"] = f"{name}@{entry['digest']}"
        elif entry.get("newTag"):
            container["image"] = f"{name}:{entry['newTag']}"
        else:
            container["image"] = name + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")


# ---------------------------------------------------------------------------- patches


def _matches_target(r: Resource, target: dict[str, Any]) -> bool:
    group, version = r.group_version
    if "kind" in target and target["kind"] != r.kind:
        return False
    if "group" in target and target["group"] != group:
        return False
    if "version" in target and target["version"] != version:
        return False
    if "name" in target and not re.fullmatch(target["name"], r.name):
        return False
    if "namespace" in target and not re.fullmatch(target["namespace"], r.namespace):
        return False
    if "labelSelector" in target and not _selector_matches(
        target["labelSelector"], r.obj.get("metadata", {}).get("labels", {}) or {}
    ):
        return False
    return not ("annotationSelector" in target and not _selector_matches(
        target["annotationSelector"], r.obj.get("metadata", {}).get("annotations", {}) or {}
    ))


def _selector_matches(selector: str, labels: dict[str, str]) -> bool:
    for term in (t.strip() for t in selector.split(",") if t.strip()):
        if "!=" in term:
            key, value = (s.strip() for s in term.split("!=", 1))
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = (s.strip() for s in term.replace("==", "=").split("=", 1))
            if labels.get(key) != value:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def _apply_patch(
    resources: list[Resource], patch: Any, target: dict[str, Any] | None, kfile: Path,
    *, json6902: bool = False,
) -> None:
    if patch is None:
        raise RenderError(f"{kfile}: empty patch")
    if isinstance(patch, list) or json6902:
        if not target:
            raise RenderError(f"{kfile}: a JSON 6902 patch needs a target")
        matched = [r for r in resources if _matches_target(r, target)]
        if not matched:
            raise RenderError(f"{kfile}: patch target {target} matches nothing")
        for r in matched:
            r.obj = apply_json6902(r.obj, patch, where=f"{kfile}: {r.kind}/{r.name}")
        return
    if not isinstance(patch, dict):
        raise RenderError(f"{kfile}: a patch must be a JSON 6902 list or an object")
    if target:
        matched = [r for r in resources if _matches_target(r, target)]
    else:
        meta = patch.get("metadata", {}) or {}
        matched = [
            r for r in resources if r.kind == patch.get("kind") and r.name == meta.get("name")
            and (not meta.get("namespace") or meta.get("namespace") == r.namespace)
        ]
    if not matched:
        raise RenderError(f"{kfile}: strategic-merge patch {patch.get('kind')}/"
                          f"{(patch.get('metadata') or {}).get('name')} matches nothing")
    for r in matched:
        body = copy.deepcopy(patch)
        if target:
            # With a target, the patch's own kind and name are only placeholders.
            body["kind"] = r.kind
            body.setdefault("metadata", {})["name"] = r.name
        if body.get("$patch") == "delete":
            resources.remove(r)
            continue
        name_before = r.name
        r.obj = strategic_merge(r.obj, body)
        if r.name != name_before:
            raise RenderError(f"{kfile}: a patch may not rename {r.kind}/{name_before}")


def strategic_merge(base: Any, patch: Any, field_name: str = "") -> Any:
    """Kubernetes strategic merge (the subset used here): maps merge, keyed lists merge
    by their merge key, other lists are replaced, ``null`` deletes, and ``$patch:
    replace|delete`` directives are honoured."""
    if isinstance(patch, dict):
        if patch.get("$patch") == "replace":
            return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
        if not isinstance(base, dict):
            return {k: copy.deepcopy(v) for k, v in patch.items() if v is not None}
        merged = dict(base)
        for key, value in patch.items():
            if key.startswith("$"):
                continue
            if value is None:
                merged.pop(key, None)
            elif key in merged:
                merged[key] = strategic_merge(merged[key], value, key)
            else:
                merged[key] = strategic_merge(None, value, key)
        return merged
    if isinstance(patch, list):
        key = MERGE_KEYS.get(field_name)
        if field_name == "ports":
            key = "containerPort" if any(isinstance(i, dict) and "containerPort" in i
                                         for i in (base or []) + patch) else "port"
        if key is None or not isinstance(base, list):
            return [strategic_merge(None, item) if isinstance(item, dict) else item for item in patch]
        # kustomize (kyaml) orders the result: the patch's items in patch order (merged
        # with their base item when one exists), then the remaining base items.
        base_by_key = {item.get(key): item for item in base if isinstance(item, dict)}
        patched: list[Any] = []
        touched: set[Any] = set()
        for item in patch:
            if not isinstance(item, dict) or key not in item:
                raise RenderError(f"list {field_name}: patch item without merge key {key!r}")
            touched.add(item[key])
            if item.get("$patch") == "delete":
                continue
            patched.append(strategic_merge(copy.deepcopy(base_by_key.get(item[key])), item))
        rest = [copy.deepcopy(item) for item in base
                if not (isinstance(item, dict) and item.get(key) in touched)]
        return patched + rest
    return copy.deepcopy(patch)


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise RenderError(f"JSON pointer {path!r} must start with '/'")
    return [part.replace("~1", "/").replace("~0", "~") for part in path[1:].split("/")]


def _walk(doc: Any, parts: list[str], path: str) -> Any:
    node = doc
    for part in parts:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise RenderError(f"JSON patch path {path!r} does not exist")
    return node


def apply_json6902(doc: dict[str, Any], ops: list[dict[str, Any]], where: str = "") -> dict[str, Any]:
    """Apply RFC 6902 operations (add, remove, replace, move, copy, test)."""
    doc = copy.deepcopy(doc)
    for op in ops:
        try:
            doc = _json6902_op(doc, op)
        except RenderError as err:
            raise RenderError(f"{where}: {err}") from None
    return doc


def _json6902_op(doc: Any, op: dict[str, Any]) -> Any:
    kind, path = op.get("op"), op.get("path", "")
    parts = _pointer(path)
    parent = _walk(doc, parts[:-1], path)
    last = parts[-1]

    def put(value: Any, replace: bool) -> None:
        if isinstance(parent, dict):
            if replace and last not in parent:
                raise RenderError(f"replace: {path!r} does not exist")
            parent[last] = value
        elif isinstance(parent, list):
            if last == "-" and not replace:
                parent.append(value)
            elif last.isdigit() and int(last) <= len(parent) - (1 if replace else 0):
                if replace:
                    parent[int(last)] = value
                else:
                    parent.insert(int(last), value)
            else:
                raise RenderError(f"{kind}: bad list index in {path!r}")
        else:
            raise RenderError(f"{kind}: {path!r} has no container")

    def take() -> Any:
        if isinstance(parent, dict) and last in parent:
            return parent.pop(last)
        if isinstance(parent, list) and last.isdigit() and int(last) < len(parent):
            return parent.pop(int(last))
        raise RenderError(f"remove: {path!r} does not exist")

    if kind == "add":
        put(copy.deepcopy(op["value"]), replace=False)
    elif kind == "replace":
        put(copy.deepcopy(op["value"]), replace=True)
    elif kind == "remove":
        take()
    elif kind == "test":
        if _walk(doc, parts, path) != op["value"]:
            raise RenderError(f"test failed at {path!r}: expected {op['value']!r}")
    elif kind in ("move", "copy"):
        source_parts = _pointer(op["from"])
        value = _walk(doc, source_parts, op["from"])
        if kind == "move":
            src_parent = _walk(doc, source_parts[:-1], op["from"])
            if isinstance(src_parent, list):
                src_parent.pop(int(source_parts[-1]))
            else:
                src_parent.pop(source_parts[-1])
        put(copy.deepcopy(value), replace=False)
    else:
        raise RenderError(f"unknown JSON patch op {kind!r}")
    return doc


# ---------------------------------------------------------------------------- names


# (referenced kind, how to find the reference fields in a referrer)
def _pod_specs(obj: dict[str, Any]) -> Iterator[dict[str, Any]]:
    kind = obj.get("kind")
    spec = obj.get("spec", {}) or {}
    if kind == "Pod":
        yield spec
    elif kind == "CronJob":
        yield ((spec.get("jobTemplate", {}) or {}).get("spec", {}) or {}).get("template", {}).get("spec", {})
    elif "template" in spec:
        yield (spec.get("template", {}) or {}).get("spec", {}) or {}


def _reference_slots(obj: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any], str]]:
    """(referenced kind, dict holding the name, key of the name) for every reference."""
    for pod in _pod_specs(obj):
        if "serviceAccountName" in pod:
            yield "ServiceAccount", pod, "serviceAccountName"
        for secret in pod.get("imagePullSecrets", []) or []:
            yield "Secret", secret, "name"
        for volume in pod.get("volumes", []) or []:
            if "configMap" in volume:
                yield "ConfigMap", volume["configMap"], "name"
            if "secret" in volume:
                yield "Secret", volume["secret"], "secretName"
            if "persistentVolumeClaim" in volume:
                yield "PersistentVolumeClaim", volume["persistentVolumeClaim"], "claimName"
            for source in (volume.get("projected", {}) or {}).get("sources", []) or []:
                if "configMap" in source:
                    yield "ConfigMap", source["configMap"], "name"
                if "secret" in source:
                    yield "Secret", source["secret"], "name"
        for container in _containers(pod):
            for env in container.get("env", []) or []:
                value_from = env.get("valueFrom", {}) or {}
                if "configMapKeyRef" in value_from:
                    yield "ConfigMap", value_from["configMapKeyRef"], "name"
                if "secretKeyRef" in value_from:
                    yield "Secret", value_from["secretKeyRef"], "name"
            for source in container.get("envFrom", []) or []:
                if "configMapRef" in source:
                    yield "ConfigMap", source["configMapRef"], "name"
                if "secretRef" in source:
                    yield "Secret", source["secretRef"], "name"
    if obj.get("kind") == "HorizontalPodAutoscaler":
        ref = (obj.get("spec", {}) or {}).get("scaleTargetRef", {}) or {}
        if ref.get("kind"):
            yield str(ref["kind"]), ref, "name"


def _fix_references(resources: list[Resource], renames: dict[tuple[str, str, str], str]) -> None:
    by_kind_name: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for (kind, namespace, old), new in renames.items():
        by_kind_name.setdefault((kind, old), []).append((namespace, new))
    for r in resources:
        for kind, holder, key in _reference_slots(r.obj):
            candidates = by_kind_name.get((kind, str(holder.get(key, ""))), [])
            same_ns = [new for ns, new in candidates if ns == r.namespace]
            choice = same_ns or [new for _ns, new in candidates]
            if len(set(choice)) == 1:
                holder[key] = choice[0]
            elif len(set(choice)) > 1:
                raise RenderError(f"{r.kind}/{r.name}: ambiguous reference to {kind} {holder[key]}")


def _go_json(value: Any) -> str:
    """json.Marshal's encoding: sorted keys, no spaces, HTML-safe escapes."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return (text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


# kustomize (after kubectl) swaps these hex digits so a suffix never looks like a number.
_HASH_ALPHABET = str.maketrans("013ae", "ghkmt")


def content_hash(obj: dict[str, Any]) -> str:
    """kustomize's name suffix for a generated ConfigMap or Secret (api/hasher)."""
    kind = obj["kind"]
    # kustomize looks the name up as the single path element "metadata/name", which
    # never matches: the name it hashes is always "" (so only kind, data and type count).
    encoded: dict[str, Any] = {"kind": kind, "name": "", "data": obj.get("data", "")}
    if kind == "Secret":
        encoded["type"] = obj.get("type", "")
        if isinstance(obj.get("stringData"), dict):
            encoded["stringData"] = obj["stringData"]
    if kind == "ConfigMap" and isinstance(obj.get("binaryData"), dict):
        encoded["binaryData"] = obj["binaryData"]
    digest = hashlib.sha256(_go_json(encoded).encode()).hexdigest()
    return digest[:10].translate(_HASH_ALPHABET)


def _add_hashes_and_fix_references(resources: list[Resource]) -> None:
    renames: dict[tuple[str, str, str], str] = {}
    for r in resources:
        if r.generated and r.hash_suffix:
            old = r.name
            r.rename(f"{old}-{content_hash(r.obj)}")
            renames[(r.kind, r.namespace, old)] = r.name
    if renames:
        _fix_references(resources, renames)


# ---------------------------------------------------------------------------- output


def dump(objects: Iterable[dict[str, Any]]) -> str:
    """Objects as one multi-document YAML stream."""
    return "---\n".join(yaml.safe_dump(obj, sort_keys=True, default_flow_style=False) for obj in objects)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deploy.tools.render",
        description="Render a kustomization directory (the subset of kustomize llmesh uses).",
    )
    parser.add_argument("directory", help="directory holding kustomization.yaml")
    args = parser.parse_args(argv)
    try:
        sys.stdout.write(dump(build(args.directory)))
    except RenderError as err:
        print(f"render: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
