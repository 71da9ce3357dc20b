"""The cluster's certificates, made at its start with openssl into its temporary directory.

One CA signs every certificate; each client's identity is its subject, as Kubernetes reads it:
CN the user, O the groups. kubelet's is `system:node:<name>` in `system:nodes`, so the Node
authorizer and NodeRestriction judge it as they judge a real node's. Keys are P-256 (an RSA key
costs a second of CPU here each).
"""
from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Dict, List, Optional

DAYS = "2"


def _openssl(args: List[str], cwd: Path) -> None:
    run = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)}: {run.stderr.strip()}")


def _key(path: Path) -> None:
    _openssl(["genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(path)], path.parent)


class PKI:
    """A CA and the certificates signed by it, as files in `root`."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.ca_key, self.ca = root / "ca.key", root / "ca.crt"
        _key(self.ca_key)
        _openssl(["req", "-x509", "-new", "-key", str(self.ca_key), "-days", DAYS, "-subj", "/CN=atedevd-e2e-ca",
                  "-out", str(self.ca)], root)
        # The service accounts' token signing key (a key pair, no certificate).
        self.sa_key, self.sa_pub = root / "sa.key", root / "sa.pub"
        _key(self.sa_key)
        _openssl(["pkey", "-in", str(self.sa_key), "-pubout", "-out", str(self.sa_pub)], root)

    def issue(self, name: str, cn: str, groups: tuple = (), sans: Optional[List[str]] = None) -> Dict[str, Path]:
        """A certificate for `cn` in `groups`, for clients; with `sans`, for a server too."""
        key, csr, crt, ext = (self.root / f"{name}.{s}" for s in ("key", "csr", "crt", "ext"))
        _key(key)
        subject = "".join(f"/O={g}" for g in groups) + f"/CN={cn}"
        _openssl(["req", "-new", "-key", str(key), "-subj", subject, "-out", str(csr)], self.root)
        lines = ["basicConstraints=CA:FALSE", "keyUsage=critical,digitalSignature,keyEncipherment",
                 "extendedKeyUsage=clientAuth" + (",serverAuth" if sans else "")]
        if sans:
            lines.append("subjectAltName=" + ",".join(sans))
        ext.write_text("\n".join(lines) + "\n")
        _openssl(["x509", "-req", "-in", str(csr), "-CA", str(self.ca), "-CAkey", str(self.ca_key),
                  "-CAcreateserial", "-days", DAYS, "-extfile", str(ext), "-out", str(crt)], self.root)
        return {"cert": crt, "key": key}

    def kubeconfig(self, path: Path, server: str, cert: Dict[str, Path]) -> Path:
        """A kubeconfig that reaches `server` as the certificate's subject."""
        path.write_text(f"""apiVersion: v1
kind: Config
clusters:
- name: e2e
  cluster: {{server: "{server}", certificate-authority: "{self.ca}"}}
users:
- name: e2e
  user: {{client-certificate: "{cert['cert']}", client-key: "{cert['key']}"}}
contexts:
- name: e2e
  context: {{cluster: e2e, user: e2e}}
current-context: e2e
""")
        return path
