"""Strict schema validation of every object every kustomization under deploy/k8s renders.

Built-in kinds are checked by kubernetes-validate against Kubernetes' own OpenAPI
schemas in strict mode (an unknown or misspelt field is an error, not silently dropped
by the API server). Kinds backed by a CustomResourceDefinition (LeaderWorkerSet, ...) are
checked against their published schemas vendored under deploy/k8s/schemas/ (see the
README there), in either form:

- a JSON schema at ``<group>/<kind>_<version>.json`` (the CRDs-catalog layout kubeconform
  reads), or with ``x-kubernetes-group-version-kind`` naming what it describes;
- the CustomResourceDefinition itself (``*.yaml``), whose ``openAPIV3Schema`` per version
  is made strict here (objects with ``properties`` refuse other keys unless the schema
  says ``x-kubernetes-preserve-unknown-fields``).

A kind with neither a built-in nor a vendored schema is an error naming it.

Usage: ``python -m deploy.tools.validate [DIR ...]`` (default: every kustomization under
deploy/k8s); exit status 1 on any problem.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

from deploy.tools.kustomize import K8S, REPO, KustomizeError, build, kustomization_dirs

SCHEMAS = K8S / "schemas"
K8S_VERSION = "1.33"
"""Kubernetes version whose schemas the manifests must satisfy (1.33 has the native
preStop sleep action the Deployments use)."""

GroupVersionKind = tuple[str, str, str]


def gvk(obj: dict[str, Any]) -> GroupVersionKind:
    group, _, version = str(obj.get("apiVersion", "")).rpartition("/")
    return group, version, str(obj.get("kind", ""))


def _strict(schema: Any) -> Any:
    """An openAPIV3Schema with unknown fields refused, as the API server prunes them."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@dataclass
class CustomSchemas:
    """The vendored CRD schemas, by (group, version, kind)."""

    schemas: dict[GroupVersionKind, dict[str, Any]] = field(default_factory=dict)
    sources: dict[GroupVersionKind, Path] = field(default_factory=dict)

    @classmethod
    def load(cls, root: Path = SCHEMAS) -> CustomSchemas:
        found = cls()
        if not root.is_dir():
            return found
        for path in sorted(root.rglob("*.json")):
            schema = json.loads(path.read_text(encoding="utf-8"))
            kinds = schema.get("x-kubernetes-group-version-kind") or []
            if not kinds:  # <group>/<kind>_<version>.json
                kind, _, version = path.stem.rpartition("_")
                kinds = [{"group": path.parent.name, "version": version, "kind": kind}]
            for entry in kinds:
                found._add((entry["group"], entry["version"], entry["kind"]), schema, path)
        for path in sorted([*root.rglob("*.yaml"), *root.rglob("*.yml")]):
            for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
                if not doc or doc.get("kind") != "CustomResourceDefinition":
                    continue
                spec = doc["spec"]
                for version in spec.get("versions", []):
                    body = (version.get("schema") or {}).get("openAPIV3Schema")
                    if body:
                        key = (spec["group"], version["name"], spec["names"]["kind"])
                        found._add(key, _strict(copy.deepcopy(body)), path)
        return found

    def _add(self, key: GroupVersionKind, schema: dict[str, Any], path: Path) -> None:
        # A kind is matched case-insensitively by file name; keep the object's spelling.
        self.schemas[key] = schema
        self.sources[key] = path

    def find(self, key: GroupVersionKind) -> dict[str, Any] | None:
        group, version, kind = key
        for (g, v, k), schema in self.schemas.items():
            if (g, v, k.lower()) == (group, version, kind.lower()):
                return schema
        return None


def _where(path: Any) -> str:
    return "/".join(str(p) for p in path) or "(root)"


def validate_object(obj: dict[str, Any], custom: CustomSchemas, version: str = K8S_VERSION) -> list[str]:
    """Problems with one object ("" paths are the object itself); empty when it is valid."""
    name = f"{obj.get('kind')}/{(obj.get('metadata') or {}).get('name')}"
    key = gvk(obj)
    schema = custom.find(key)
    if schema is not None:
        validator = jsonschema.validators.validator_for(schema)(schema)
        return [
            f"{name}: {err.message} at {_where(err.absolute_path)}"
            for err in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.path)))
        ]
    missing = [
        f"{name}: no schema for kind {key[2]} of {obj.get('apiVersion')} (group {key[0] or 'core'}): "
        f"neither Kubernetes {version} nor deploy/k8s/schemas/ has one; vendor its CRD's "
        f"published schema as deploy/k8s/schemas/{key[0]}/{key[2].lower()}_{key[1]}.json"
    ]
    if not is_builtin_group(key[0]):
        # kubernetes-validate looks kinds up by the group's first label only, so a CRD
        # kind could otherwise be checked against a built-in kind of the same name.
        return missing
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        return missing
    except kubernetes_validate.ValidationError as err:
        # kubernetes-validate stops at the first error; report every one, as kubeconform does.
        errors = _all_builtin_errors(obj, version) or [f"{err.message} at {_where(err.path)}"]
        return [f"{name}: {e}" for e in errors]
    return []


def is_builtin_group(group: str) -> bool:
    """API groups Kubernetes itself serves: core (""), apps, batch, ..., *.k8s.io (but not
    the *.x-k8s.io groups of SIG projects, which are CRDs)."""
    return "." not in group or (group.endswith(".k8s.io") and not group.endswith(".x-k8s.io"))


def _all_builtin_errors(obj: dict[str, Any], version: str) -> list[str]:
    """Every strict-schema error of a built-in object (through kubernetes-validate's schema
    files); empty if its internals are not what this expects."""
    try:
        from kubernetes_validate import utils
        from referencing import Registry, Resource

        newest = [v for v in utils.all_versions() if utils.major_minor(v) <= version][-1]
        schema_dir = f"v{newest}-local-strict"
        group, _, api = str(obj["apiVersion"]).rpartition("/")
        api_version = f"{group.split('.')[0]}-{api}" if group else api
        schema = utils.schema_contents(
            f"kubernetes-json-schema/{schema_dir}/{str(obj['kind']).lower()}-{api_version}.json", version
        )
        defs = utils.schema_contents(f"kubernetes-json-schema/{schema_dir}/_definitions.json", version)
    except (AttributeError, ImportError, IndexError, OSError, ValueError):
        return []
    registry = Resource.from_contents(defs) @ (Resource.from_contents(schema) @ Registry())  # type: ignore[var-annotated]
    validator = jsonschema.Draft202012Validator(schema, registry=registry)
    return [f"{e.message} at {_where(e.absolute_path)}"
            for e in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.path)))]


def validate_objects(objects: list[dict[str, Any]], custom: CustomSchemas | None = None) -> list[str]:
    custom = custom or CustomSchemas.load()
    return [problem for obj in objects for problem in validate_object(obj, custom)]


def check(directories: list[Path]) -> list[str]:
    """Render each kustomization and validate everything it renders."""
    custom = CustomSchemas.load()
    problems = []
    for directory in directories:
        where = str(directory.relative_to(REPO)) if directory.is_relative_to(REPO) else str(directory)
        try:
            objects = build(directory)
        except KustomizeError as err:
            problems.append(f"{where}: {err}")
            continue
        if not objects:
            problems.append(f"{where}: renders nothing")
        problems += [f"{where}: {p}" for p in validate_objects(objects, custom)]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deploy.tools.validate",
        description="Render kustomizations with kubectl kustomize and validate every object "
        f"strictly (Kubernetes {K8S_VERSION} schemas; CRD kinds against deploy/k8s/schemas/).",
    )
    parser.add_argument("directories", nargs="*", type=Path,
                        help="kustomization directories (default: every one under deploy/k8s)")
    args = parser.parse_args(argv)
    directories = [d.resolve() for d in args.directories] or kustomization_dirs()
    problems = check(directories)
    for problem in problems:
        print(problem)
    print(f"{len(directories)} kustomization(s), {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
