"""atedevd: grants host device nodes to the pods that request them, via kubelet's device plugin API."""

__version__ = "0.1.0"
