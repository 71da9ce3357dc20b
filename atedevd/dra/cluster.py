"""The API server, as DRA mode needs it, through the official kubernetes client (Debian's
python3-kubernetes 22.6 and newer): who the credentials are, the Node, a claim, and the node's
ResourceSlices. Nothing here parses a kubeconfig or writes a request by hand.

The credentials are kubelet's own by default (the node authorizer lets `system:node:<name>`
create, update, list, watch and delete the ResourceSlices of its node, and get the claims of
pods bound to it), found where kubeadm, EKS and k3s put kubelet's kubeconfig; or the
kubeconfig `[daemon] kubeconfig` names. Kubelet rotates its client certificate in place
(`kubelet-client-current.pem`); the client reads the files when it connects, and an answer of
401 makes the next call build the client again from the kubeconfig.
"""

import os
from typing import Iterator, List, Optional, Tuple

KUBELET_KUBECONFIGS = (
    "/etc/kubernetes/kubelet.conf",  # kubeadm
    "/var/lib/kubelet/kubeconfig",  # EKS (amazon-eks-ami)
    "/var/lib/rancher/k3s/agent/kubelet.kubeconfig",  # k3s
)
CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 40.0  # below kubelet's 45 s for a prepare; a watch ends on the server's side first
WATCH_TIMEOUT_S = 30
NODE_USER_PREFIX = "system:node:"


class ClusterError(Exception):
    """The API server could not be asked, or refused: the message names what and why; `status`
    is the HTTP status of a refusal (None: no answer)."""

    def __init__(self, message: str, status: Optional[int] = None) -> None:
        super().__init__(message)
        self.status = status


def find_kubeconfig(configured: Optional[str]) -> Tuple[Optional[str], str]:
    """(the kubeconfig to use, "") or (None, why there is none)."""
    if configured:
        return (configured, "") if os.path.isfile(configured) else (None, f"[daemon] kubeconfig {configured}: no such file")
    for path in KUBELET_KUBECONFIGS:
        if os.path.isfile(path):
            return path, ""
    return None, ("no kubeconfig: kubelet's is at none of " + ", ".join(KUBELET_KUBECONFIGS) +
                  "; name one with [daemon] kubeconfig")


def _reason(e: BaseException) -> str:
    status = getattr(e, "status", None)
    if status:
        return f"HTTP {status} {getattr(e, 'reason', '')}".strip()
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


class KubeApi:
    """One API server, through one kubeconfig."""

    def __init__(self, kubeconfig: str) -> None:
        self.kubeconfig = kubeconfig
        self._client = None
        self._resources: dict = {}

    def _dynamic(self):
        if self._client is None:
            try:
                import urllib3
                from kubernetes import config as kube_config
                from kubernetes.dynamic import DynamicClient
                from kubernetes.dynamic.discovery import LazyDiscoverer

                api = kube_config.new_client_from_config(config_file=self.kubeconfig)
                # Every call ends: a connect or an answer that takes longer is an error (the client has no default).
                api.rest_client.pool_manager.connection_pool_kw["timeout"] = urllib3.Timeout(
                    connect=CONNECT_TIMEOUT_S, read=READ_TIMEOUT_S)
                self._client = DynamicClient(api, discoverer=LazyDiscoverer)
            except ImportError as e:
                raise ClusterError(f"DRA mode needs the kubernetes client (python3-kubernetes): {e}")
            except Exception as e:  # a kubeconfig the library refuses, a server that does not answer discovery
                raise ClusterError(f"{self.kubeconfig}: {_reason(e)}")
            self._resources = {}
        return self._client

    def _resource(self, api_version: str, kind: str):
        key = (api_version, kind)
        if key not in self._resources:
            self._resources[key] = self._dynamic().resources.get(api_version=api_version, kind=kind)
        return self._resources[key]

    def _call(self, what: str, fn):
        try:
            return fn()
        except ClusterError:
            raise
        except Exception as e:
            if getattr(e, "status", None) == 401:  # a rotated certificate, a renewed token: built again next time
                self._client = None
            raise ClusterError(f"{what}: {_reason(e)}", getattr(e, "status", None)) from e

    def warm_up(self) -> None:
        """Discovery of what DRA mode asks for, done now, so that threads asking at once later
        find it made (the client's discovery cache is not made for threads filling it together)."""
        for api_version, kind in (("resource.k8s.io/v1", "ResourceClaim"), ("resource.k8s.io/v1", "ResourceSlice")):
            self._call(f"discovery of {kind}", lambda: self._resource(api_version, kind))

    def whoami(self) -> str:
        """The user the credentials are (`system:node:<name>` for kubelet's)."""
        review = {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}
        out = self._call("who the credentials are (SelfSubjectReview)", lambda: self._resource(
            "authentication.k8s.io/v1", "SelfSubjectReview").create(body=review))
        return str(out.to_dict().get("status", {}).get("userInfo", {}).get("username", ""))

    def node_uid(self, node: str) -> str:
        return str((self.node(node).get("metadata") or {}).get("uid") or "")

    def node(self, node: str) -> dict:
        return self._call(f"the Node {node}", lambda: self._resource("v1", "Node").get(name=node)).to_dict()

    def device_class(self, name: str) -> dict:
        return self._call(f"DeviceClass {name}", lambda: self._resource(
            "resource.k8s.io/v1", "DeviceClass").get(name=name)).to_dict()

    def claim(self, namespace: str, name: str) -> dict:
        out = self._call(f"ResourceClaim {namespace}/{name}", lambda: self._resource(
            "resource.k8s.io/v1", "ResourceClaim").get(name=name, namespace=namespace))
        return out.to_dict()

    def slices(self, node: str, driver: str) -> Tuple[List[dict], str]:
        """The node's slices of a driver, and the list's resourceVersion (to watch from)."""
        out = self._call("list ResourceSlices", lambda: self._resource("resource.k8s.io/v1", "ResourceSlice").get(
            field_selector=f"spec.nodeName={node},spec.driver={driver}"))
        doc = out.to_dict()
        return list(doc.get("items") or ()), str((doc.get("metadata") or {}).get("resourceVersion") or "")

    def create_slice(self, body: dict) -> None:
        self._call(f"create ResourceSlice {body['metadata']['name']}",
                   lambda: self._resource("resource.k8s.io/v1", "ResourceSlice").create(body=body))

    def replace_slice(self, body: dict, resource_version: str) -> None:
        body = dict(body, metadata=dict(body["metadata"], resourceVersion=resource_version))
        self._call(f"update ResourceSlice {body['metadata']['name']}",
                   lambda: self._resource("resource.k8s.io/v1", "ResourceSlice").replace(body=body))

    def delete_slice(self, name: str) -> None:
        try:
            self._call(f"delete ResourceSlice {name}",
                       lambda: self._resource("resource.k8s.io/v1", "ResourceSlice").delete(name=name))
        except ClusterError as e:
            if e.status != 404:
                raise

    def watch_slices(self, node: str, driver: str, resource_version: str) -> Iterator[str]:
        """The types of the events on the node's slices of a driver (ADDED, MODIFIED, DELETED),
        until the server ends the watch (WATCH_TIMEOUT_S)."""
        resource = self._call("watch ResourceSlices", lambda: self._resource("resource.k8s.io/v1", "ResourceSlice"))
        events = self._call("watch ResourceSlices", lambda: iter(self._dynamic().watch(
            resource, field_selector=f"spec.nodeName={node},spec.driver={driver}",
            resource_version=resource_version or None, timeout=WATCH_TIMEOUT_S)))
        while True:
            try:
                event = next(events)
            except StopIteration:
                return
            except Exception as e:
                raise ClusterError(f"watch ResourceSlices: {_reason(e)}") from e
            yield str(event.get("type"))
